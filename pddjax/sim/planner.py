"""Capacity planning: which pool sizes (and line) serve a traffic within an SLA at least cost.

Two questions:
- `best_split`: given a number of instances of one kind (the same-DC baseline: 88 GPU-A),
  which P:D split serves the most SLA-meeting requests/s?
- `cheapest`: given a target rate, which deployment meets the SLA at that rate for the least
  hardware cost per hour? BCR at a fixed rate is rate / cost, so the cheapest passing
  deployment is the BCR-maximizing one. Across the line we then look for the narrowest
  bandwidth (from the candidates) with which the same pools still pass.

`best_split` ranks splits with the analytic bound of `capacity.py` and simulates the best
few; `cheapest` searches pool by pool with the simulator. Every probe is recorded in `log`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pddjax.sim.capacity import TraceStats, analytic_rps, bounds, meets, nominal_for, sla_rps
from pddjax.sim.config import ClusterConfig, Pool, Sla
from pddjax.workload.config import WorkloadConfig
from pddjax.workload.generator import generate


@dataclass
class PlanResult:
    cfg: ClusterConfig | None
    rps: float  # SLA-meeting rate (best_split) or target rate (cheapest)
    summary: dict | None
    log: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        if self.cfg is None:
            return {"feasible": False, "probes": self.log}
        s = self.summary or {}
        return {
            "feasible": True, "deployment": self.cfg.describe(), "rps": self.rps,
            "cost_per_hour": self.cfg.cost_per_hour, "bcr": self.rps / self.cfg.cost_per_hour,
            "ttft_ms": s.get("ttft_ms"), "tpot_ms": s.get("tpot_ms"), "attainment": s.get("attainment"),
            "rld_token_share": s.get("rld_token_share"), "pipelines": s.get("pipelines"),
            "wan_gbps_used": s.get("wan_gbps_used"), "probes": self.log,
        }


def best_split(base: ClusterConfig, total: int, wl: WorkloadConfig, sla: Sla, top: int = 2,
               steps: int = 5) -> PlanResult:
    """Best P:D split of `total` instances for `base`'s mode and instance types."""
    st = TraceStats.of(generate(wl, until=wl.duration_s))
    cands = [base.replace(p=Pool(base.p.perf, n), d=Pool(base.d.perf, total - n)) for n in range(1, total)]
    cands.sort(key=lambda c: -analytic_rps(c, st))
    best = PlanResult(None, 0.0, None)
    for cfg in cands[:top]:
        rps, s = sla_rps(cfg, wl, sla, steps=steps, upper=1.1 * analytic_rps(cfg, st))
        best.log.append({"deployment": cfg.describe(), "sla_rps": rps})
        if rps > best.rps:
            best.cfg, best.rps, best.summary = cfg, rps, s
    return best


def cheapest(base: ClusterConfig, rps: float, wl: WorkloadConfig, sla: Sla, wans: list[float],
             max_p: int = 64, max_d: int = 64, max_rld: int = 4) -> PlanResult:
    """Least-cost deployment of `base.mode` meeting `sla` at `rps` (offered req/s).

    Coordinate search, each probe one simulation: start from twice the analytic need of
    each pool (growing everything 1.5x until it passes), then find the fewest P instances
    that still pass, then the fewest D/MD, then (PDD) the fewest RLD, then the narrowest
    line. Assumes more instances never hurt, which holds up to simulation noise."""
    nominal = nominal_for(wl, rps)
    st = TraceStats.of(generate(wl.with_request_rate(nominal), until=wl.duration_s))
    res = PlanResult(None, rps, None)
    pdd = base.mode == "pdd"
    line = max(wans) if base.mode != "pd-local" else base.wan_gbps

    def make(n_p: int, n_d: int, n_r: int, gbps: float) -> ClusterConfig:
        return base.replace(p=Pool(base.p.perf, n_p), d=Pool(base.d.perf, n_d), wan_gbps=gbps,
                            rld=Pool(base.rld.perf, n_r) if pdd else base.rld)

    def ok(cfg: ClusterConfig) -> bool:
        passed, s = meets(cfg, wl, nominal, sla)
        res.log.append({"deployment": cfg.describe(), "attainment": s["attainment"], "ok": passed})
        if passed and (res.cfg is None or cfg.cost_per_hour <= res.cfg.cost_per_hour):
            res.cfg, res.summary = cfg, s
        return passed

    one = bounds(make(1, 1, 1, line), st)
    n = {"p": min(max_p, math.ceil(2 * rps / one["P"])), "d": min(max_d, math.ceil(2 * rps / one["D"])),
         "r": 1 if pdd else 0}
    while not ok(make(n["p"], n["d"], n["r"], line)):
        if n["p"] >= max_p and n["d"] >= max_d:
            return res
        n["p"], n["d"] = min(max_p, math.ceil(1.5 * n["p"])), min(max_d, math.ceil(1.5 * n["d"]))
        n["r"] = min(max_rld, n["r"] + 1) if pdd else 0
    for key in ("p", "d", "r") if pdd else ("p", "d"):
        lo, hi = 1, n[key]  # hi passes
        while lo < hi:
            mid = (lo + hi) // 2
            trial = dict(n, **{key: mid})
            if ok(make(trial["p"], trial["d"], trial["r"], line)):
                hi = mid
            else:
                lo = mid + 1
        n[key] = hi
    best = make(n["p"], n["d"], n["r"], line)
    res.cfg = best if res.cfg is None or res.cfg.cost_per_hour > best.cost_per_hour else res.cfg
    if base.mode != "pd-local":
        for w in sorted(wans):
            if w < line and ok(make(n["p"], n["d"], n["r"], w)):
                res.cfg = make(n["p"], n["d"], n["r"], w)
                break
    return res
