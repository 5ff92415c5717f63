"""Run one simulation and collect its summary: the single entry point scenarios use."""

from __future__ import annotations

from pddjax.sim.cluster import Cluster
from pddjax.sim.config import ClusterConfig, Sla
from pddjax.sim.metrics import hit_timeline, summarize
from pddjax.workload.trace import TraceRequest


def simulate(cfg: ClusterConfig, trace: list[TraceRequest], sla: Sla = Sla(),
             timeline_bins: int = 0) -> dict:
    """Simulate `trace` on `cfg`; the summary of `metrics.summarize` plus cost and pool stats."""
    cl = Cluster(cfg, trace)
    reqs = cl.run()
    cl.check_integrity()
    out = summarize(reqs, sla)
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
