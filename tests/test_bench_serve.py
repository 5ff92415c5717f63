"""`pddjax bench serve` end to end on the tiny model: a 2-3 session trace through every mode
(fresh stacks, emulated WAN), the JSON schema the simulator and the issue ask for, the output
identity check, and the figures helpers on hand-made records."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from pddjax.serving import bench_serve as bs
from pddjax.workload import WorkloadConfig, generate, write_trace

pytestmark = pytest.mark.timeout(600)


def small_trace(path):
    cfg = WorkloadConfig(seed=3, duration_s=6.0, session_rate=0.5, turns_mean=2.0, turns_max=3, context_tokens=160,
                         output_median=6, output_sigma=0.5, output_max=12, n_docs=2, think_mean_s=0.1)
    reqs = generate(cfg)
    sessions = sorted({r.session_id for r in reqs})[:3]
    reqs = [r for r in reqs if r.session_id in sessions]
    write_trace(path, reqs, {"seed": cfg.seed})
    return reqs


def test_bench_serve_end_to_end_writes_the_schema(tmp_path):
    trace = tmp_path / "trace.jsonl"
    reqs = small_trace(trace)
    assert 2 <= len({r.session_id for r in reqs}) <= 3
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, "-m", "pddjax", "bench", "serve", "--model", "tiny", "--trace", str(trace),
                        "--json", str(out), "--wan-mbps", "20", "--wan-latency-ms", "5", "--wan-jitter-ms", "1",
                        "--no-warmup"], capture_output=True, text=True, timeout=580)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["modes"]) == {"pdd", "pd-cross", "pd-local", "pdd-drc-off"}
    for name, m in res["modes"].items():
        assert m["completed"] == len(reqs), (name, m)
        for s in ("p50", "p90", "p99", "max"):
            assert m["ttft_ms"][s] > 0
        assert isinstance(m["wan_bytes"], int) and 0.0 <= m["rld_token_share"] <= 1.0
        assert sum(m["pipelines"].values()) == len(reqs)
        for k in ("tpot_ms", "itl_ms", "e2e_ms", "req_per_s", "handoff"):
            assert k in m
    assert res["modes"]["pd-local"]["rld_token_share"] == 1.0
    assert res["modes"]["pd-cross"]["rld_token_share"] == 0.0
    assert res["modes"]["pd-local"]["wan_bytes"] < res["modes"]["pd-cross"]["wan_bytes"]
    assert res["modes"]["pdd-drc-off"]["wan_bytes"] > res["modes"]["pdd"]["wan_bytes"]
    assert res["outputs"]["identical"], res["outputs"]
    assert "| pdd |" in p.stdout and "pdd_p99_over_pd_cross" in res["targets"]
    from pddjax.sim.validate import load_measured

    load_measured(out)  # the simulator accepts it


def rec(rid, toks, ttft=100.0, relay=0, pipeline="pd-cross"):
    r = bs.Record(rid, 0, 0, 0.9, 100, send_s=0.0, pipeline=pipeline, ttft_ms=ttft, e2e_ms=ttft + 50,
                  tpot_ms=10.0, itl_ms=[10.0] * (len(toks) - 1), token_ids=toks, relay_tokens=relay,
                  main_tokens=len(toks) - relay)
    return r


def test_figures_identity_and_targets_by_hand():
    a = [rec("r1", [1, 2, 3], 100), rec("r2", [4, 5], 300, relay=1, pipeline="pdd")]
    b = [rec("r1", [1, 2, 3], 500), rec("r2", [4, 6], 900)]
    m = bs.mode_figures(a, 2.0, 1000, 10)
    assert m["ttft_ms"]["max"] == 300 and m["ttft_ms"]["p50"] == 200
    assert m["rld_token_share"] == 0.2 and m["pipelines"] == {"pd-cross": 1, "pdd": 1}
    ident = bs.identity_check({"pdd": a, "pd-cross": b})
    assert not ident["identical"] and ident["mismatches"][0] == {"mode": "pd-cross", "request_id": "r2",
                                                                  "first_diff": 1, "against": "pdd"}
    t = bs.targets({"pdd": m, "pd-cross": bs.mode_figures(b, 2.0, 1000, 0), "pd-local": m,
                    "pdd-drc-off": {**m, "wan_bytes": 6000}})
    assert t["pdd_p99_over_pd_local"]["met"] and t["wan_bytes_drc_off_over_on"]["value"] == 6.0
    assert t["pdd_p99_over_pd_cross"]["met"] == (t["pdd_p99_over_pd_cross"]["value"] <= 0.5)
    assert math.isnan(bs.pct([])["p50"] or math.nan)
