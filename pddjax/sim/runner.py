"""Run one simulation and collect its summary: the single entry point scenarios use."""

from __future__ import annotations

from pddjax.sim.cluster import Cluster
from pddjax.sim.config import ClusterConfig, Sla
from pddjax.sim.metrics import hit_timeline, summarize, window_of
from pddjax.workload.config import WorkloadConfig
from pddjax.workload.generator import generate
from pddjax.workload.trace import TraceRequest

DEFAULT_SLA = Sla()


def simulate(cfg: ClusterConfig, trace: list[TraceRequest], sla: Sla = DEFAULT_SLA,
             timeline_bins: int = 0, horizon: float | None = None, measure_all: bool = False) -> dict:
    """Simulate `trace` on `cfg` (requests sent up to `horizon`; default: the last session
    start, or every request if `measure_all`); the summary of `metrics.summarize` over the
    measurement window (or all requests) plus cost and pool statistics."""
    if measure_all and horizon is None:
        horizon = float("inf")
    cl = Cluster(cfg, trace, horizon)
    reqs = cl.run()
    cl.check_integrity()
    end = max(r.arrival for r in reqs)
    window = (0.0, max(end, 1e-9)) if measure_all else window_of(cl.horizon, cl.history)
    out = summarize(reqs, sla, window)
    end = cl.loop.now or 1.0
    out["cost_per_hour"] = cfg.cost_per_hour
    out["events"] = cl.loop.events_run
    out["utilization"] = {
        "P": sum(p.busy_time for p in cl.P) / (end * len(cl.P)),
        "D": sum(d.busy_time for d in cl.D) / (end * len(cl.D)),
        "RLD": sum(r.busy_time for r in cl.R) / (end * len(cl.R)) if cl.R else 0.0,
    }
    out["max_batch"] = {"D": cl.D[0].max_batch, "RLD": cl.R[0].max_batch if cl.R else 0}
    out["drc_evictions"] = sum(d.cache.evictions for d in cl.D)
    out["drc_peak_fraction"] = max(d.cache.peak / max(1, d.cache.capacity) for d in cl.D)
    out["extend_passes"] = sum(d.extend_passes for d in cl.D)
    out["handoff_id_bytes"] = cl.handoff.id_bytes
    out["cancelled_transfers"] = cl.handoff.cancelled_transfers
    if timeline_bins:
        out["timeline"] = hit_timeline(reqs, timeline_bins)
    return out


def simulate_workload(cfg: ClusterConfig, wl: WorkloadConfig, sla: Sla = DEFAULT_SLA,
                      timeline_bins: int = 0) -> dict:
    """Generate `wl` (up to its duration) and simulate it on `cfg` with horizon = duration."""
    trace = generate(wl, until=wl.duration_s)
    return simulate(cfg, trace, sla, timeline_bins, horizon=wl.duration_s)
