"""Throughput: a quick analytic bound per pool, and the SLA-meeting rate found by simulation.

Analytic bound (used to rank candidate deployments and to bracket the search), requests/s:
- P:   n_P / mean prefill seconds, each request prefilling (prompt - P hit) tokens, where
       P's hit is the trace prefix minus the previous output (P never caches outputs);
- D:   n_D * B / (step_s(B, B * ctx) * mean output), B = min(TPOT-capped batch, KV capacity
       / (prompt + output)), ctx = mean prompt + output / 2;
- WAN: line bytes/s / mean KV delta bytes, delta = new tokens (DRC holds the rest);
- RLD: not a bound (it decodes a small share; the simulation judges it).
The bound is optimistic (no queueing, perfect cache); the simulation decides.

SLA-meeting rate: the largest offered request rate whose simulation meets the SLA, by
bisection (within 0.4x-1.1x the analytic bound, or below it), for a fixed number of steps. Each probe
regenerates the workload at that rate with the same seed: the same sessions, their start
times scaled (common random numbers), so probes differ only in load.
"""

from __future__ import annotations

from dataclasses import dataclass

from pddjax.sim.cluster import max_batch_for
from pddjax.sim.config import ClusterConfig, Sla
from pddjax.sim.metrics import window_of
from pddjax.sim.runner import simulate_workload
from pddjax.workload.config import WorkloadConfig
from pddjax.workload.generator import generate
from pddjax.workload.trace import TraceRequest


@dataclass(frozen=True)
class TraceStats:
    prompt: float  # mean prompt tokens
    output: float  # mean output tokens
    new: float  # mean tokens MD lacks (new_tokens)
    prefill_pairs: list[tuple[int, int]]  # (new, cached) per request as P sees it

    @classmethod
    def of(cls, trace: list[TraceRequest]) -> TraceStats:
        prev_out: dict[tuple[int, int], int] = {(r.session_id, r.turn): r.output_tokens for r in trace}
        pairs = []
        for r in trace:
            lost = prev_out.get((r.session_id, r.turn - 1), 0) if r.kind == "append" else 0
            hit = max(0, min(r.prefix_tokens - lost, r.prompt_tokens - 1))
            pairs.append((r.prompt_tokens - hit, hit))
        n = len(trace)
        return cls(
            prompt=sum(r.prompt_tokens for r in trace) / n, output=sum(r.output_tokens for r in trace) / n,
            new=sum(r.new_tokens for r in trace) / n, prefill_pairs=pairs,
        )


def bounds(cfg: ClusterConfig, st: TraceStats) -> dict[str, float]:
    """Analytic requests/s bound of each pool (see module docstring)."""
    p = cfg.p.perf
    step = 64  # sample every 64th request: plenty for a mean
    sample = st.prefill_pairs[::max(1, len(st.prefill_pairs) // step)] or [(1, 0)]
    mean_prefill = sum(p.prefill_s(n, c) for n, c in sample) / len(sample)
    ctx = st.prompt + st.output / 2
    d = cfg.d.perf
    b = min(max_batch_for(d, ctx, cfg.tpot_target_s), int(d.kv_capacity_tokens // (st.prompt + st.output)))
    b = max(1, b)
    out = {
        "P": cfg.p.count / mean_prefill,
        "D": cfg.d.count * b / (d.step_s(b, b * ctx) * st.output),
    }
    if cfg.mode != "pd-local":
        out["WAN"] = cfg.wan_gbps * 1e9 / 8 / max(1.0, st.new * d.kv_bytes_per_token)
    return out


def analytic_rps(cfg: ClusterConfig, st: TraceStats) -> float:
    return min(bounds(cfg, st).values())


def offered_rps(wl: WorkloadConfig) -> float:
    """Requests/s the trace schedules inside the measurement window (no simulation)."""
    w0, w1 = window_of(wl.duration_s, wl.warm_start_s > 0)
    n = sum(w0 <= r.arrival_s <= w1 for r in generate(wl, until=wl.duration_s))
    return n / (w1 - w0)


def nominal_for(wl: WorkloadConfig, target: float) -> float:
    """The nominal rate (session_rate * turns_mean) whose trace offers `target` req/s."""
    probe = wl.with_request_rate(target)
    return target * target / max(offered_rps(probe), 1e-9)


def meets(cfg: ClusterConfig, wl: WorkloadConfig, rps: float, sla: Sla) -> tuple[bool, dict]:
    """Simulate `wl` at `rps` requests/s on `cfg`; (SLA met?, summary)."""
    s = simulate_workload(cfg, wl.with_request_rate(rps), sla)
    return bool(s["sla_met"]), s


def sla_rps(cfg: ClusterConfig, wl: WorkloadConfig, sla: Sla, steps: int = 5,
            upper: float | None = None, floor: float = 0.4) -> tuple[float, dict | None]:
    """Largest SLA-meeting throughput; (measured req/s of the best passing probe, its summary).

    Probes the offered rate at `upper` (default 1.1x the analytic bound), then at
    floor * upper, then bisects `steps` times between the highest pass and lowest failure
    known (0 counts as a pass)."""
    if upper is None:
        upper = 1.1 * analytic_rps(cfg, TraceStats.of(generate(wl, until=wl.duration_s)))
    best, best_s = 0.0, None
    ok, s = meets(cfg, wl, upper, sla)
    if ok:
        return s["rps"], s
    lo, hi = floor * upper, upper
    ok, s = meets(cfg, wl, lo, sla)
    if ok:
        best, best_s = s["rps"], s
    else:
        lo, hi = 0.0, lo
    for _ in range(steps):
        mid = (lo + hi) / 2
        ok, s = meets(cfg, wl, mid, sla)
        if ok:
            lo, best, best_s = mid, s["rps"], s
        else:
            hi = mid
    return best, best_s
