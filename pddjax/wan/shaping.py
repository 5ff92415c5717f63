"""When does a chunk of bytes arrive at the far end of an emulated WAN line? Pure Python.

One `Wire` per direction, shared by every connection on that direction (a leased line is one
pipe): a token bucket whose rate follows a bandwidth-over-time trace, stall windows during
which nothing leaves, a one-way latency plus jitter drawn from a configurable distribution,
and in-order delivery (TCP never reorders, so jitter can delay but not overtake).
"""

from __future__ import annotations

import dataclasses
import math
import random


@dataclasses.dataclass
class LinkProfile:
    mbps: float = 0.0  # 0 = unlimited
    latency_ms: float = 0.0  # one way
    jitter_ms: float = 0.0  # scale of the jitter distribution
    jitter_dist: str = "normal"  # "normal" (|N(0, j)|) | "uniform" [0, j] | "exponential" (mean j) | "pareto"
    burst_bytes: int = 256 * 1024  # token bucket depth
    trace: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # [(t_s, mbps)] steps
    trace_loop: bool = True  # repeat the trace after its last step
    stalls: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # [(start_s, dur_s)]
    seed: int = 0

    def validate(self) -> None:
        if self.mbps < 0 or self.latency_ms < 0 or self.jitter_ms < 0 or self.burst_bytes < 1:
            raise ValueError("WAN bandwidth, latency, jitter must be >= 0 and the burst >= 1 byte")
        if self.jitter_dist not in ("normal", "uniform", "exponential", "pareto"):
            raise ValueError(f"unknown jitter distribution {self.jitter_dist!r}")
        if any(b[0] < a[0] for a, b in zip(self.trace, self.trace[1:])) or any(m < 0 for _, m in self.trace):
            raise ValueError("the bandwidth trace must have increasing times and rates >= 0")


class Wire:
    """Schedules chunks on one direction of the line. Times are seconds since `t0` (any clock)."""

    def __init__(self, profile: LinkProfile, t0: float = 0.0):
        profile.validate()
        self.p, self.t0 = profile, t0
        self.rng = random.Random(profile.seed)
        self.free_at = t0  # when the line finishes sending what it already accepted
        self.tokens = float(profile.burst_bytes)
        self.tokens_at = t0
        self.last_delivery = t0
        self.bytes = 0

    # ---- bandwidth over time ---------------------------------------------------------
    def rate_bps(self, t: float) -> float:
        """Bytes per second at absolute time t (inf when unlimited)."""
        p = self.p
        mbps = p.mbps
        if p.trace:
            rel = t - self.t0
            span = p.trace[-1][0]
            if p.trace_loop and span > 0 and rel > span:
                rel = rel % span
            for start, m in p.trace:
                if rel >= start:
                    mbps = m
        return math.inf if mbps <= 0 and not p.trace else max(mbps, 0.0) * 1e6 / 8

    def _after_stalls(self, t: float) -> float:
        for start, dur in self.p.stalls:
            s = self.t0 + start
            if s <= t < s + dur:
                t = s + dur
        return t

    def _send_time(self, start: float, nbytes: float) -> float:
        """Time at which nbytes have left, starting at `start`, integrating the rate."""
        t, left = start, nbytes
        for _ in range(100000):
            t = self._after_stalls(t)
            r = self.rate_bps(t)
            if math.isinf(r):
                return t
            step = 0.01  # integrate in 10 ms slices so trace changes and stalls apply mid-chunk
            if r > 0 and left <= r * step:
                return t + left / r
            left -= r * step
            t += step
        return t

    # ---- one chunk -------------------------------------------------------------------
    def schedule(self, now: float, nbytes: int) -> float:
        """Accept `nbytes` at `now`; returns when they are delivered at the far end."""
        self.bytes += nbytes
        start = self._after_stalls(max(now, self.free_at))
        r = self.rate_bps(start)
        if math.isinf(r):
            done = start
        else:  # token bucket: a burst up to the bucket depth leaves at once
            self.tokens = min(self.p.burst_bytes, self.tokens + r * (start - self.tokens_at))
            if self.tokens >= nbytes:
                self.tokens -= nbytes
                done = start
            else:
                done = self._send_time(start, nbytes - self.tokens)
                self.tokens = 0.0
            self.tokens_at = done
        self.free_at = done
        arrive = done + (self.p.latency_ms + self._jitter_ms()) / 1e3
        self.last_delivery = max(arrive, self.last_delivery)  # in order
        return self.last_delivery

    def _jitter_ms(self) -> float:
        j, d = self.p.jitter_ms, self.p.jitter_dist
        if j <= 0:
            return 0.0
        if d == "normal":
            return abs(self.rng.gauss(0.0, j))
        if d == "uniform":
            return self.rng.uniform(0.0, j)
        if d == "exponential":
            return self.rng.expovariate(1.0 / j)
        return j * (self.rng.paretovariate(2.5) - 1.0)  # heavy tail, mean ~ j * 2/3
