"""`pddjax sim` and `pddjax plan`, and the host lab's `python -m tools.hostlab.validate`: user
errors exit 2 with one sentence; small runs work."""

import json

import pytest

from pddjax.workload import generate
from pddjax.workload.config import WorkloadConfig
from serving.cli import main
from tools.hostlab.validate import PROG
from tools.hostlab.validate import main as validate_main

ENGINE = {"model": "smollm2-135m", "decode_ms": {"1": 9.1, "8": 10.4, "32": 15.0},
          "extend_ms": {"1": 9.0, "16": 11.2, "64": 19.8}, "prefill_tokens_per_s": 5200.0}
# A benchmark JSON as `bench serve` writes it (the parts validation reads): a small workload
# with history, the emulated WAN, per-mode TTFT percentiles.
WORKLOAD = {"seed": 0, "duration_s": 8.0, "session_rate": 0.3, "turns_mean": 3.0, "turns_max": 4,
            "context_tokens": 256, "context_spread": 0.1, "n_docs": 2, "doc_zipf": 1.1,
            "hit_mix": [[0.76, 0.95, 1.0], [0.17, 0.6, 0.95], [0.07, 0.0, 0.6]], "output_median": 8,
            "output_sigma": 0.8, "output_max": 32, "output_fixed": None, "think_mean_s": 1.0,
            "nominal_ttft_s": 1.0, "nominal_tpot_s": 0.02, "warm_start_s": 5.0}
MEASURED = {"modes": {m: {"ttft_ms": {"p50": 300, "p90": 600, "p99": 900}} for m in ("pdd", "pd-cross", "pd-local")},
            "wan": {"mbps": 20.0, "latency_ms": 20.0, "jitter_ms": 5.0}, "trace": {"config": WORKLOAD}}


@pytest.mark.parametrize("argv, fragment", [
    (["plan", "--traffic", "context=8k"], "rps="),
    (["plan", "--traffic", "rps=1,colour=red"], "unknown key"),
    (["plan", "--traffic", "rps=-1"], "positive"),
    (["plan", "--traffic", "rps=1,hit=1.5"], "hit must be"),
    (["plan", "--traffic", "rps=1", "--sla", "ttft=2"], "--sla takes"),
    (["plan", "--traffic", "rps=1", "--accelerators", "tpu-v9"], "unknown accelerator"),
    (["plan", "--traffic", "rps=1", "--accelerators", "measured:/nonexistent.json"], "cannot read"),
    (["plan", "--traffic", "rps=1", "--wan-gbps", "10,x"], "must be a number"),
    (["plan", "--traffic", "rps=1", "--modes", "pdq"], "--modes"),
    (["sim", "--scenario", "paper"], "--json"),
    (["sim", "--scenario", "paper", "--json", "/tmp/x.json", "--model", "gpt-9"], "unknown model"),
])
def test_user_errors_exit_2_with_one_sentence(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pddjax: error: ") and fragment in err
    assert err.count("\n") == 0 and err.endswith(".")


def test_validate_without_measured_exits_2_with_one_sentence(capsys):
    assert validate_main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{PROG}: error: ") and "no measured benchmark file" in err
    assert err.count("\n") == 0 and err.endswith(".")


def test_sim_has_no_validate_scenario(capsys):
    """Validation is the host lab's command now (tools/hostlab), not a `pddjax sim` scenario."""
    with pytest.raises(SystemExit) as e:
        main(["sim", "--scenario", "validate"])
    assert e.value.code == 2 and "invalid choice: 'validate'" in capsys.readouterr().err


def test_validate_needs_profile_and_rejects_bad_measured(tmp_path, capsys):
    measured = tmp_path / "m.json"
    measured.write_text(json.dumps(MEASURED))
    assert validate_main(["--measured", str(measured)]) == 2
    assert "engine profile" in capsys.readouterr().err
    engine = tmp_path / "e.json"
    engine.write_text(json.dumps(ENGINE))
    measured.write_text(json.dumps({"modes": {"pdd": {"ttft_ms": {"p50": "fast"}}}}))
    assert validate_main(["--measured", str(measured), "--engine-profile", str(engine)]) == 2
    assert "p50 and p99" in capsys.readouterr().err


def test_validate_prints_predicted_against_measured(tmp_path, capsys):
    measured, engine, out = tmp_path / "m.json", tmp_path / "e.json", tmp_path / "v.json"
    measured.write_text(json.dumps(MEASURED))
    engine.write_text(json.dumps(ENGINE))
    assert validate_main(["--measured", str(measured), "--engine-profile", str(engine),
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| pdd | p50 |" in table and "| pd-local | p99 |" in table
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 6 and all(r["predicted_ms"] > 0 for r in result["rows"])
    assert result["wan"] == {"mbps": 20.0, "latency_ms": 20.0, "jitter_ms": 5.0}  # the benchmark's
    trace = generate(WorkloadConfig(**{**WORKLOAD, "hit_mix": tuple(map(tuple, WORKLOAD["hit_mix"]))}))
    live = sum(r.arrival_s >= 0 for r in trace)
    assert 0 < live < len(trace)  # the workload has history and measured turns
    for m in ("pdd", "pd-cross", "pd-local"):  # every measured turn simulated, none of the history
        assert result["predicted"]["modes"][m]["ttft_ms"]["n"] == live


def test_validate_rejects_a_bad_calibration(tmp_path, capsys):
    measured, engine, cal = tmp_path / "m.json", tmp_path / "e.json", tmp_path / "c.json"
    measured.write_text(json.dumps(MEASURED))
    engine.write_text(json.dumps(ENGINE))
    cal.write_text(json.dumps({"attention_ns_per_pair": -1}))
    argv = ["--measured", str(measured), "--engine-profile", str(engine)]
    assert validate_main([*argv, "--calibration", str(cal)]) == 2
    assert "attention_ns_per_pair" in capsys.readouterr().err
    assert validate_main([*argv, "--calibration", str(tmp_path / "missing.json")]) == 2
    assert "cannot read calibration" in capsys.readouterr().err


def test_validate_without_trace_or_workload_config_says_so(tmp_path, capsys):
    measured, engine = tmp_path / "m.json", tmp_path / "e.json"
    measured.write_text(json.dumps({**MEASURED, "trace": {}}))
    engine.write_text(json.dumps(ENGINE))
    assert validate_main(["--measured", str(measured), "--engine-profile", str(engine)]) == 2
    assert "--trace FILE" in capsys.readouterr().err


def test_plan_small_model_runs(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--traffic", "rps=0.5,context=4k,output=64", "--accelerators", "l40s,l40s@1.5",
                 "--model", "smollm2-135m", "--sla", "ttft=2,tpot=0.05", "--json", str(out)]) == 0
    assert "| pdd |" in capsys.readouterr().out
    plans = json.loads(out.read_text())["plans"]
    assert set(plans) == {"pd-local", "pd-cross", "pdd"} and all(p["feasible"] for p in plans.values())
    assert plans["pdd"]["deployment"]["RLD"]["count"] >= 1


def test_validate_against_several_runs_uses_their_median_and_shows_each(tmp_path, capsys):
    """Runs of one trace: measured = the median of the runs' P50 / P99, each run's value and the
    spread printed; a run of another setup is refused with a sentence."""
    engine = tmp_path / "e.json"
    engine.write_text(json.dumps(ENGINE))
    paths = []
    for i, scale in enumerate((1.0, 2.0, 1.5)):
        run = json.loads(json.dumps(MEASURED))
        for fig in run["modes"].values():
            fig["ttft_ms"] = {k: v * scale for k, v in fig["ttft_ms"].items()}
        paths.append(tmp_path / f"m{i}.json")
        paths[-1].write_text(json.dumps(run))
    out = tmp_path / "v.json"
    argv = ["--engine-profile", str(engine), "--measured", *map(str, paths)]
    assert validate_main([*argv, "--json", str(out)]) == 0
    assert "300 / 600 / 450 | 67% |" in capsys.readouterr().out  # pdd p50 of the three runs; (max - min) / median
    rows = {(r["mode"], r["stat"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[("pdd", "p50")]["measured_ms"] == 450 and rows[("pd-local", "p99")]["measured_ms"] == 1350
    other = json.loads(json.dumps(MEASURED))
    other["wan"]["mbps"] = 40.0
    paths[1].write_text(json.dumps(other))
    assert validate_main(argv) == 2
    assert "differs from run 1 in 'wan'" in capsys.readouterr().err
