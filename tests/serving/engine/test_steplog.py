"""The engine thread's step log (PDDJAX_STEP_LOG) and its analysis against a step table:
what `python -m tools.hostlab.steplog` reports is exactly what the worker logged."""

import asyncio
import json
import time

import pytest

from pddjax.engines.fake_engine import FakeEngine
from pddjax.model.sampling_params import SamplingParams
from serving.engine.steplog import StepLog
from serving.engine.worker import EngineWorker
from tools.hostlab import steplog


def test_worker_logs_each_step_and_command_with_the_threads_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PDDJAX_STEP_LOG", str(tmp_path))
    loop = asyncio.new_event_loop()
    eng = FakeEngine()
    worker = EngineWorker(eng, loop, name="engine-test")

    def admit(e, seq_id):
        e.add(seq_id, [5, 6, 7], SamplingParams(), 3)

    async def go():
        await worker.call(admit, "a")
        while eng.has_work():
            await asyncio.sleep(0.01)
    loop.run_until_complete(go())
    worker.stop()
    loop.close()
    entries = steplog.read_log(str(next(tmp_path.glob("engine-test-*.jsonl"))))
    kinds = [e["k"] for e in entries]
    assert kinds.count("step") == worker.steps >= 3  # the fake engine emits one token per step
    assert any(e["k"] == "cmd" and e["name"] == "admit" for e in entries)
    threads = [e for e in entries if e["k"] == "threads"]
    assert threads and all(e["engine"] >= 0 and e["main"] >= 0 for e in threads)
    assert all(e["wall"] >= 0 and e["cpu"] >= 0 for e in entries if e["k"] != "threads")


def test_no_log_unless_asked(monkeypatch):
    monkeypatch.delenv("PDDJAX_STEP_LOG", raising=False)
    assert StepLog.from_env("engine-x") is None


def test_summary_counts_the_window_only_and_compares_with_the_table(tmp_path):
    """Three logged steps, two inside the window, one of a shape the table has (0.1 s)."""
    lines = [
        {"k": "step", "t": 9.0, "wall": 5.0, "cpu": 0.0, "shape": [1, 1, 64, 1, 1]},  # before the window
        {"k": "threads", "t": 9.5, "engine": 1.0, "main": 1.0, "other": 10.0, "names": {"tf_XLAEigen": 10.0}},
        {"k": "step", "t": 10.5, "wall": 0.15, "cpu": 0.01, "shape": [1, 1, 64, 1, 1]},
        {"k": "step", "t": 11.0, "wall": 0.40, "cpu": 0.02, "shape": [4, 4, 64, 1, 4]},
        {"k": "cmd", "t": 11.2, "wall": 0.05, "cpu": 0.05, "name": "_import_all"},
        {"k": "threads", "t": 12.5, "engine": 1.5, "main": 1.2, "other": 13.0, "names": {"tf_XLAEigen": 12.5}},
    ]
    path = tmp_path / "engine-main-42.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"k\": \"st")  # a line cut short
    table = {(1, 1, 64, 1): 0.1}
    s = steplog.summarize(steplog.read_log(str(path)), (10.0, 12.0), table)
    assert s["steps"] == 2 and s["step_wall_s"] == pytest.approx(0.55)
    assert s["table_s"] == pytest.approx(0.1) and s["covered_wall_s"] == pytest.approx(0.15)
    assert s["covered"] == pytest.approx(0.5)
    assert s["commands_s"] == {"_import_all": pytest.approx(0.05)}
    # thread CPU interpolated between the snapshots at 9.5 and 12.5: 2/3 of their difference
    assert s["threads_s"]["other"] == pytest.approx(2.0) and s["threads_s"]["engine"] == pytest.approx(1 / 3)
    assert s["threads_s"]["other:tf_XLAEigen"] == pytest.approx(5 / 3)
    measured = {"modes": {"pdd": {"pids": {"main": 42, "relay": 43}, "window": [10.0, 12.0],
                                  "cpu_s": {"main": 3.0}}}}
    out = steplog.analyse(measured, str(tmp_path), table)
    assert list(out["pdd"]) == ["main"] and out["pdd"]["main"]["cpu_s"] == 3.0  # relay left no log


def test_cli_says_when_there_is_no_log(tmp_path, capsys):
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"modes": {"pdd": {"pids": {"main": 1}, "window": [0, time.time()]}}}))
    assert steplog.main(["--measured", str(bench), "--logs", str(tmp_path)]) == 2
    assert "PDDJAX_STEP_LOG" in capsys.readouterr().err


def _write_log(path, steps):
    """steps: (start, end, shape) -> a step log whose entries end at `end` and last end - start."""
    path.write_text("\n".join(json.dumps({"k": "step", "t": e, "wall": round(e - s, 6), "cpu": 0.0, "shape": shape})
                              for s, e, shape in steps) + "\n")


def test_interference_is_read_from_the_runs_own_step_logs(tmp_path):
    """Relay decode steps (table 0.1 s) take 0.1 s with core 0 idle and 0.13 s under a small P
    chunk: decode|small = 1.3. P's small chunk (table 0.2 s) takes 0.2 s alone and 0.22 s
    under decode steps: small|decode = 1.1. A relay step that MD (same core) overlapped and
    steps of shapes the table lacks do not count."""
    from tools.hostlab import interference

    dec, dec_wide, chunk, chunk_new = [1, 1, 64, 1, 1], [1, 1, 128, 1, 1], [32, 1, 64, 32, 1], [64, 1, 64, 64, 1]
    relay = [(0.2 * i, 0.2 * i + 0.1, dec) for i in range(6)]  # alone (one of them shared with MD below)
    relay += [(10 + 0.15 * i, 10 + 0.15 * i + 0.13, dec) for i in range(5)]  # under P's long chunk
    relay += [(20 + i, 20 + i + 0.22, dec_wide) for i in range(5)]  # covering P's chunks (not in the table)
    prefill = [(2 + i, 2 + i + 0.2, chunk) for i in range(5)]  # alone
    prefill += [(10, 10.8, chunk_new)]  # covers the relay steps; its own shape is not in the table
    prefill += [(20 + i, 20 + i + 0.22, chunk) for i in range(5)]  # under decode steps
    main = [(0.0, 0.05, dec)]  # overlaps relay's first step on the same core
    for name, pid, steps in (("relay", 2, relay), ("prefill", 1, prefill), ("main", 3, main)):
        _write_log(tmp_path / f"engine-{name}-{pid}.jsonl", steps)
    measured = {"cpus": {"prefill": [0], "relay": [1], "main": [1]},
                "modes": {"pdd": {"pids": {"prefill": 1, "relay": 2, "main": 3}, "window": [0, 100]}}}
    table = {(1, 1, 64, 1): 0.1, (32, 1, 64, 32): 0.2}
    cross, counts = interference.from_run(measured, str(tmp_path), table)
    assert cross == {"decode|small": pytest.approx(1.3), "small|decode": pytest.approx(1.1)}
    assert counts["decode"] == {"alone": 5, "small": 5} and counts["small"] == {"alone": 5, "decode": 5}
    with pytest.raises(ValueError, match="pin"):
        interference.from_run({**measured, "cpus": {}}, str(tmp_path), table)


def test_several_calibrations_predict_their_median():
    from tools.hostlab.validate import compare, ensemble, format_table

    def pred(p50, p99):
        return {"modes": {"pdd": {"ttft_ms": {"p50": p50, "p99": p99}, "requests": []}}}
    both = ensemble([pred(1000, 5000), pred(2000, 7000), pred(1600, 9000)])
    assert both["modes"]["pdd"]["ttft_ms"] == {"p50": 1600, "p99": 7000}
    rows = compare(both, {"modes": {"pdd": {"ttft_ms": {"p50": 1600, "p99": 7000}}}})
    assert [r["ok"] for r in rows] == [True, True] and "1000 / 2000 / 1600" in format_table(rows)
