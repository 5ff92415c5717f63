"""The engine thread's step log (PDDJAX_STEP_LOG) and its analysis against a step table:
what `python -m pddjax.sim.steplog` reports is exactly what the worker logged."""

import asyncio
import json
import time

import pytest

from pddjax.engines.fake_engine import FakeEngine
from pddjax.model.sampling import SamplingParams
from pddjax.serving.steplog import StepLog
from pddjax.serving.worker import EngineWorker
from pddjax.sim import steplog


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
