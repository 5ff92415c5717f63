"""From finished requests to the figures the scenarios report.

Measurement window: the simulator sends requests over [0, H] (H = horizon, the end of the
session-start window). Without history the load ramps up while the first sessions are
young, so we measure requests *sent* in [0.3 H, H]; with history (sessions in progress at
t=0, caches warm) only queues need filling, and we measure [0.1 H, H]. Throughput is the
number of measured requests over the window length. SLA attainment is the share of measured
requests with TTFT <= sla.ttft_s and TPOT <= sla.tpot_s.
"""

from __future__ import annotations

import numpy as np

from pddjax.sim.config import Sla
from pddjax.sim.request import SimRequest

WARMUP_COLD, WARMUP_WARM = 0.3, 0.1


def window_of(horizon: float, history: bool) -> tuple[float, float]:
    """Measurement window [start, end] of send times (see module docstring)."""
    return (WARMUP_WARM if history else WARMUP_COLD) * horizon, horizon


def pct(xs, qs=(50, 90, 99)) -> dict:
    """Percentiles of xs as {"p50": ..., ..., "max": ...}; zeros for an empty list."""
    if len(xs) == 0:
        return {**{f"p{q}": 0.0 for q in qs}, "max": 0.0, "mean": 0.0}
    a = np.asarray(xs, dtype=float)  # [n]
    out = {f"p{q}": float(np.percentile(a, q)) for q in qs}
    out["max"], out["mean"] = float(a.max()), float(a.mean())
    return out


def summarize(reqs: list[SimRequest], sla: Sla, window: tuple[float, float]) -> dict:
    """Headline metrics of the requests sent within `window`."""
    w0, w1 = window
    meas = [r for r in reqs if w0 <= r.arrival <= w1] or reqs
    span = max(w1 - w0, 1e-9)
    ttft = [r.ttft for r in meas]
    tpot = [r.tpot for r in meas if r.output > 1]
    ok = sum(r.ttft <= sla.ttft_s and r.tpot <= sla.tpot_s for r in meas)
    out_tokens = sum(r.output for r in meas)
    pipes: dict[str, int] = {}
    for r in meas:
        pipes[r.pipeline] = pipes.get(r.pipeline, 0) + 1
    prompt = sum(r.prompt for r in meas)
    ho = [r.handoff_end - r.handoff_start for r in meas if r.handoff_end >= 0]
    return {
        "requests": len(meas),
        "rps": len(meas) / span,
        "attainment": ok / len(meas),
        "sla_met": ok / len(meas) >= sla.attain,
        "ttft_ms": {k: v * 1e3 for k, v in pct(ttft).items()},
        "tpot_ms": {k: v * 1e3 for k, v in pct(tpot).items()},
        "e2e_s": pct([r.finish - r.arrival for r in meas]),
        "wan_bytes": float(sum(r.wan_bytes for r in meas)),
        "wan_gbps_used": float(sum(r.wan_bytes for r in meas)) * 8 / 1e9 / span,
        "rld_token_share": sum(r.rld_tokens for r in meas) / out_tokens,
        "pipelines": pipes,
        "mean_ideal_hit": sum(r.prefix for r in meas) / prompt,
        "mean_p_hit": sum(r.p_hit for r in meas) / prompt,
        "mean_md_hit": sum(r.md_hit for r in meas) / prompt,
        "handoff_ms": {k: v * 1e3 for k, v in pct(ho).items()},
        "window_s": [w0, w1],
    }


def hit_timeline(reqs: list[SimRequest], bins: int = 12) -> list[list[float]]:
    """[[t_mid, md_hit, p_hit, rld_share], ...]: token-weighted hit rates of requests sent in
    each of `bins` equal slices of the run, and the share of output tokens RLD produced."""
    if not reqs:
        return []
    t_end = max(r.arrival for r in reqs)
    edges = np.linspace(0.0, t_end + 1e-9, bins + 1)  # [bins+1]
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sl = [r for r in reqs if lo <= r.arrival < hi]
        if not sl:
            continue
        prompt = sum(r.prompt for r in sl)
        rows.append([
            float((lo + hi) / 2), sum(r.md_hit for r in sl) / prompt, sum(r.p_hit for r in sl) / prompt,
            sum(r.rld_tokens for r in sl) / sum(r.output for r in sl),
        ])
    return rows
