"""Workload configuration: the knobs of the agentic multi-turn generator, and presets.

An agentic session starts from one of a few long shared contexts ("docs": a repository, a
document set, a system prompt with tool definitions), then comes back turn after turn with the
whole context. Each turn draws a *target prefix-hit rate* from a mixture of uniform bins; the
generator then builds the turn so that exactly that share of its prompt repeats the session's
previous sequence (prompt + output). High-hit turns are tool-call turns that append a tool
result; low-hit turns are context edits (the agent rewrites or compacts part of its context).

The default mixture gives about three quarters of turns above 95% hit, a middle band and a
low-hit tail, mean ~0.89: the shape the PDD report describes (70-80% of requests above 95%,
mean ~90%).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# (weight, lo, hi): a turn's target hit is uniform in [lo, hi) with probability `weight`.
HitBin = tuple[float, float, float]

DEFAULT_HIT_MIX: tuple[HitBin, ...] = (
    (0.76, 0.95, 1.00),  # tool-call turns: append a short tool result
    (0.17, 0.60, 0.95),  # larger tool results / partial edits
    (0.07, 0.00, 0.60),  # context rewrites, compaction, cold-ish starts
)


def fixed_hit_mix(hit: float, spread: float = 0.02) -> tuple[HitBin, ...]:
    """A narrow mixture centred on `hit` (used by the bathtub sweep)."""
    lo, hi = max(0.0, hit - spread), min(1.0, hit + spread)
    return ((1.0, lo, hi),)


def mix_mean(mix: tuple[HitBin, ...]) -> float:
    """Mean target hit rate of a mixture."""
    total = sum(w for w, _, _ in mix)
    return sum(w * (lo + hi) / 2 for w, lo, hi in mix) / total


@dataclass(frozen=True)
class WorkloadConfig:
    """Everything `generate` needs; two equal configs give byte-identical traces."""

    seed: int = 0
    duration_s: float = 300.0  # window in which sessions start (Poisson)
    session_rate: float = 0.5  # sessions started per second
    turns_mean: float = 6.0  # turns per session: 1 + geometric, this mean
    turns_max: int = 40
    context_tokens: int = 8192  # target prompt length a session hovers around
    context_spread: float = 0.10  # per-turn prompt length in context * (1 +- spread)
    n_docs: int = 8  # shared long contexts sessions start from
    doc_zipf: float = 1.1  # popularity skew of the docs
    hit_mix: tuple[HitBin, ...] = DEFAULT_HIT_MIX
    output_median: int = 200  # lognormal output length: median, sigma, cap
    output_sigma: float = 1.0
    output_max: int = 2048
    output_fixed: int | None = None  # if set, every turn emits exactly this many tokens
    think_mean_s: float = 2.0  # tool / user time between a turn's end and the next send
    # Open-loop schedule: turn n+1's arrival_s = arrival_s(n) + nominal_ttft_s +
    # output(n) * nominal_tpot_s + think. A system at least this fast sees exactly these times;
    # a slower one sends think_s after the previous turn ends (closed loop) instead.
    nominal_ttft_s: float = 1.0
    nominal_tpot_s: float = 0.02
    warm_start_s: float = 0.0  # sessions also start in [-warm_start_s, 0): turns before 0 are history

    def __post_init__(self):
        if self.duration_s <= 0 or self.session_rate <= 0:
            raise ValueError("duration_s and session_rate must be positive")
        if self.turns_mean < 1 or self.context_tokens < 16 or self.n_docs < 1:
            raise ValueError("turns_mean >= 1, context_tokens >= 16, n_docs >= 1 required")
        if not self.hit_mix or any(w < 0 or not 0 <= lo <= hi <= 1 for w, lo, hi in self.hit_mix):
            raise ValueError("hit_mix bins must be (weight >= 0, 0 <= lo <= hi <= 1)")

    @property
    def mean_output(self) -> float:
        """Expected output tokens per turn (approximate for the capped lognormal)."""
        if self.output_fixed is not None:
            return float(self.output_fixed)
        import math

        return min(self.output_max, self.output_median * math.exp(self.output_sigma**2 / 2))

    @property
    def request_rate(self) -> float:
        """Steady-state requests per second: session_rate * turns_mean."""
        return self.session_rate * self.turns_mean

    def with_request_rate(self, rps: float) -> WorkloadConfig:
        """Same workload with the session rate scaled to give `rps` requests/s."""
        return dataclasses.replace(self, session_rate=rps / self.turns_mean)


PRESETS: dict[str, WorkloadConfig] = {
    # The report's setting: 64K context, 1K output, ~90% mean hit. Sessions already in progress
    # at t=0 (warm start) so the simulated window is in steady state from the beginning.
    "paper": WorkloadConfig(
        context_tokens=65536, output_fixed=1024, turns_mean=4.0, think_mean_s=2.0,
        duration_s=200.0, session_rate=1.0, n_docs=16, nominal_ttft_s=4.0, nominal_tpot_s=0.03,
        warm_start_s=500.0,
    ),
    # Small enough for SmolLM2-135M on a CPU: 2K contexts, short heavy-tailed outputs.
    "quick": WorkloadConfig(
        context_tokens=2048, output_median=48, output_sigma=0.8, output_max=256,
        turns_mean=4.0, duration_s=60.0, session_rate=0.1, n_docs=4, think_mean_s=0.5,
    ),
    "default": WorkloadConfig(),
}
