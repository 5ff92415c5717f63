"""`pddjax sim` and `pddjax plan`: user errors exit 2 with one sentence; small runs work."""

import json

import pytest

from pddjax.cli import main

ENGINE = {"model": "smollm2-135m", "decode_ms": {"1": 9.1, "8": 10.4, "32": 15.0},
          "extend_ms": {"1": 9.0, "16": 11.2, "64": 19.8}, "prefill_tokens_per_s": 5200.0}
MEASURED = {"modes": {m: {"ttft_ms": {"p50": 300, "p90": 600, "p99": 900}} for m in ("pdd", "pd-cross", "pd-local")}}


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
    (["sim", "--scenario", "validate"], "no measured benchmark file"),
])
def test_user_errors_exit_2_with_one_sentence(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pddjax: error: ") and fragment in err
    assert err.count("\n") == 0 and err.endswith(".")


def test_validate_needs_profile_and_rejects_bad_measured(tmp_path, capsys):
    measured = tmp_path / "m.json"
    measured.write_text(json.dumps(MEASURED))
    assert main(["sim", "--scenario", "validate", "--measured", str(measured)]) == 2
    assert "engine profile" in capsys.readouterr().err
    engine = tmp_path / "e.json"
    engine.write_text(json.dumps(ENGINE))
    measured.write_text(json.dumps({"modes": {"pdd": {"ttft_ms": {"p50": "fast"}}}}))
    assert main(["sim", "--scenario", "validate", "--measured", str(measured),
                 "--engine-profile", str(engine)]) == 2
    assert "p50 and p99" in capsys.readouterr().err


def test_validate_prints_predicted_against_measured(tmp_path, capsys):
    measured, engine, out = tmp_path / "m.json", tmp_path / "e.json", tmp_path / "v.json"
    measured.write_text(json.dumps(MEASURED))
    engine.write_text(json.dumps(ENGINE))
    assert main(["sim", "--scenario", "validate", "--measured", str(measured), "--engine-profile", str(engine),
                 "--wan-gbps", "0.5", "--wan-ms", "20", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| pdd | p50 |" in table and "| pd-local | p99 |" in table
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and all(r["predicted_ms"] > 0 for r in rows)


def test_plan_small_model_runs(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--traffic", "rps=0.5,context=4k,output=64", "--accelerators", "l40s,l40s@1.5",
                 "--model", "smollm2-135m", "--sla", "ttft=2,tpot=0.05", "--json", str(out)]) == 0
    assert "| pdd |" in capsys.readouterr().out
    plans = json.loads(out.read_text())["plans"]
    assert set(plans) == {"pd-local", "pd-cross", "pdd"} and all(p["feasible"] for p in plans.values())
    assert plans["pdd"]["deployment"]["RLD"]["count"] >= 1
