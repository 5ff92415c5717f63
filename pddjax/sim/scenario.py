"""The report's setting, end to end: `pddjax sim --scenario paper`.

Steps (all on the "paper" workload: 64K context, 1K output, ~90% mean hit, sessions in
progress at t=0; flagship-50k model; GPU-A for P / RLD / local D, GPU-B for MD):
1. SLA: TTFT <= 2x the cold prefill of a full context on one P instance, TPOT <= 50 ms,
   both for 90% of requests (decode batches are capped at a 40 ms step). The router sends a
   request through RLD when its KV is predicted to reach MD later than 10% of the TTFT SLA.
2. Baseline: same-datacenter homogeneous PD on 11 GPU-A instances (88 chips, the report's
   baseline size); best P:D split; its SLA-meeting rate R_b and cost C_b.
3. PDD: the cheapest P / RLD / MD deployment (line from 10-100 Gb/s) that meets the SLA at
   R_b; then its own SLA-meeting rate R_p and cost C_p. BCR = req/s per USD/h * 3600 (=
   requests per dollar); bcr_gain = (R_p / C_p) / (R_b / C_b) - 1.
4. TTFT against cross-datacenter PD without relay: PDD's pools, every request P-MD, at R_b,
   on the planned line (headline: P99) and on each candidate line.
5. Bathtub: PDD's deployment under narrow hit distributions from 5% to 99%, SLA-meeting
   BCR with and without extend chunks batched into decode steps, plus a revenue view.
6. Drift: long sessions on PDD's deployment (25 Gb/s line), with and without P-RLD as a
   normal path; MD's and P's hit rates over time.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ProcessPoolExecutor

from pddjax.sim.capacity import nominal_for, sla_rps
from pddjax.sim.config import ClusterConfig, Pool, Sla
from pddjax.sim.hardware import get_accelerator
from pddjax.sim.model import get_model
from pddjax.sim.planner import best_split, cheapest
from pddjax.sim.roofline import RooflineInstance
from pddjax.sim.runner import simulate_workload
from pddjax.workload.config import PRESETS, WorkloadConfig, fixed_hit_mix

REPORT = {"bcr_gain": 0.375, "ttft_reduction_vs_cross": 0.515, "rld_token_share": 0.062,
          "cost_change": [-0.071, -0.035], "rps_gain": 0.278}
BATHTUB_HITS = [0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.97]
BATHTUB_DURATION_S = 150.0  # shorter runs for the sweep (16 bisections)
WANS = [10.0, 25.0, 50.0, 100.0]
DRIFT_GBPS = 25.0  # a line on which low-hit transfers often exceed the RLD threshold
# Revenue view of the bathtub: price of a cached input token and of an output token, relative
# to an uncached input token (cache reads at 10% and output at 4x are common API list ratios).
PRICE_CACHED, PRICE_OUTPUT = 0.1, 4.0


def bcr(rps: float, cost_per_hour: float) -> float:
    """Requests served per USD of hardware time."""
    return rps * 3600.0 / cost_per_hour


def _bathtub_point(cfg: ClusterConfig, wl: WorkloadConfig, sla: Sla, hit: float) -> dict:
    w = dataclasses.replace(wl, hit_mix=fixed_hit_mix(hit), duration_s=BATHTUB_DURATION_S)
    rps, s = sla_rps(cfg, w, sla, steps=4)
    value = (1 - hit) + hit * PRICE_CACHED  # per prompt token, relative to uncached input
    per_req = value * w.context_tokens + PRICE_OUTPUT * w.mean_output
    return {"hit": hit, "rps": rps, "bcr": bcr(rps, cfg.cost_per_hour),
            "revenue_per_usd": rps * per_req * 3600.0 / cfg.cost_per_hour,
            "rld_token_share": s["rld_token_share"] if s else None,
            "extend_passes": s["extend_passes"] if s else None}


def _drift_run(cfg: ClusterConfig, wl: WorkloadConfig, sla: Sla) -> dict:
    s = simulate_workload(cfg, wl, sla, timeline_bins=10)
    return {"timeline": [[round(x, 4) for x in row] for row in s["timeline"]],
            "mean_md_hit": s["mean_md_hit"], "mean_p_hit": s["mean_p_hit"],
            "rld_token_share": s["rld_token_share"], "pipelines": s["pipelines"]}


def _pmap(fn, args: list[tuple], workers: int) -> list:
    if workers <= 1:
        return [fn(*a) for a in args]
    with ProcessPoolExecutor(max_workers=workers) as ex:
        return list(ex.map(fn, *zip(*args)))


def paper(seed: int = 0, workers: int = 2, model: str = "flagship-50k", log=print) -> dict:
    """Run the paper scenario; returns the JSON-ready result (see module docstring)."""
    t0 = time.time()
    m = get_model(model)
    a = RooflineInstance.build(get_accelerator("gpu-a"), m)
    b = RooflineInstance.build(get_accelerator("gpu-b"), m)
    wl = dataclasses.replace(PRESETS["paper"], seed=seed)
    sla = Sla(ttft_s=round(2 * a.prefill_s(wl.context_tokens, 0), 2), tpot_s=0.05, attain=0.9)
    # Decode batches capped at a 40 ms step; RLD masks transfers predicted to take more than
    # 10% of the TTFT budget.
    common = dict(tpot_target_s=0.04, seed=seed, rld_threshold_s=round(0.1 * sla.ttft_s, 3))

    log("baseline: best P:D split of 11 GPU-A instances ...")
    base = best_split(ClusterConfig("pd-local", Pool(a, 1), Pool(a, 1), **common), 11, wl, sla, top=3)
    log(f"  {base.cfg.describe()} -> {base.rps:.2f} req/s")
    log("pdd: cheapest deployment meeting the SLA at the baseline's rate ...")
    plan = cheapest(ClusterConfig("pdd", Pool(a, 1), Pool(b, 1), Pool(a, 1), **common), base.rps, wl, sla, WANS)
    pdd_cfg = plan.cfg
    if pdd_cfg is None:
        raise RuntimeError("no PDD deployment met the SLA at the baseline rate")
    pdd_rps, pdd_s = sla_rps(pdd_cfg, wl, sla, steps=5)
    log(f"  {pdd_cfg.describe()} -> {pdd_rps:.2f} req/s [{time.time() - t0:.0f} s]")

    log(f"ttft: PDD against cross-datacenter PD at the baseline's rate, per line ... [{time.time() - t0:.0f} s]")
    at = wl.with_request_rate(nominal_for(wl, base.rps))
    ttft = {}
    for gbps in sorted({pdd_cfg.wan_gbps, *WANS}):
        c = pdd_cfg.replace(wan_gbps=gbps)
        s1, s2 = simulate_workload(c, at, sla), simulate_workload(c.replace(mode="pd-cross"), at, sla)
        red = {k: 1 - s1["ttft_ms"][k] / s2["ttft_ms"][k] for k in ("p50", "p90", "p99", "mean")}
        ttft[f"{gbps:g}"] = {"rps": s1["rps"], "pdd": s1["ttft_ms"], "pd-cross": s2["ttft_ms"], "reduction": red,
                             "rld_token_share": s1["rld_token_share"], "pipelines": s1["pipelines"],
                             "sla_met": {"pdd": s1["sla_met"], "pd-cross": s2["sla_met"]}}
    s_pdd = simulate_workload(pdd_cfg, at, sla)

    log(f"bathtub and drift ... [{time.time() - t0:.0f} s]")
    jobs = [(pdd_cfg.replace(batch_extend=be), wl, sla, h) for be in (True, False) for h in BATHTUB_HITS]
    points = _pmap(_bathtub_point, jobs, workers)
    n = len(BATHTUB_HITS)
    drift_wl = dataclasses.replace(at, turns_mean=16.0, session_rate=at.request_rate / 16.0, duration_s=400.0)
    drift_cfg = pdd_cfg.replace(wan_gbps=DRIFT_GBPS)
    drift = _pmap(_drift_run, [(drift_cfg.replace(rld_normal_path=f), drift_wl, sla) for f in (False, True)], workers)

    c_b, c_p = base.cfg.cost_per_hour, pdd_cfg.cost_per_hour
    return {
        "scenario": "paper", "seed": seed, "model": dataclasses.asdict(m),
        "accelerators": {k: dataclasses.asdict(get_accelerator(k)) for k in ("gpu-a", "gpu-b")},
        "sla": dataclasses.asdict(sla),
        "workload": {k: v for k, v in dataclasses.asdict(wl).items() if k != "hit_mix"},
        "baseline": {"rps": base.rps, "cost": c_b, "deployment": base.cfg.describe(),
                     "ttft_ms": base.summary["ttft_ms"], "tpot_ms": base.summary["tpot_ms"]},
        "pdd": {"rps": pdd_rps, "cost": c_p, "deployment": pdd_cfg.describe(),
                "ttft_ms": pdd_s["ttft_ms"] if pdd_s else None, "tpot_ms": pdd_s["tpot_ms"] if pdd_s else None,
                "pipelines": s_pdd["pipelines"], "wan_gbps_used": s_pdd["wan_gbps_used"]},
        "bcr": {"baseline": bcr(base.rps, c_b), "pdd": bcr(pdd_rps, c_p)},
        "bcr_gain": bcr(pdd_rps, c_p) / bcr(base.rps, c_b) - 1,
        "rps_gain": pdd_rps / base.rps - 1,
        "cost_change": c_p / c_b - 1,
        "ttft_vs_cross_by_line_gbps": ttft,
        "ttft_reduction_vs_cross": ttft[f"{pdd_cfg.wan_gbps:g}"]["reduction"]["p99"],
        "rld_token_share": s_pdd["rld_token_share"],
        "bathtub": [[p["hit"], p["bcr"]] for p in points[:n]],
        "bathtub_unbatched_tail_chunks": [[p["hit"], p["bcr"]] for p in points[n:]],
        "bathtub_revenue": [[p["hit"], p["revenue_per_usd"]] for p in points[:n]],
        "bathtub_points": points,
        "drift": {"normal": drift[0], "rld_normal_path": drift[1], "wan_gbps": DRIFT_GBPS,
                  "columns": ["t_s", "md_hit", "p_hit", "rld_token_share"]},
        "planner_probes": {"baseline": base.log, "pdd": plan.log},
        "report": REPORT,
        "runtime_s": round(time.time() - t0, 1),
    }
