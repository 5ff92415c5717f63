"""Seeded generator of agentic multi-turn traces (see `config.py` for the model).

Per session (its own RNG stream, seeded by (seed, session_id), so adding sessions never
changes earlier ones):

1. start time: Poisson process of rate `session_rate` over [-warm_start_s, duration_s];
2. number of turns: 1 + Geometric, mean `turns_mean`, capped at `turns_max`;
3. doc: Zipf-popular shared context among `n_docs` (doc lengths seeded by (seed, doc_id));
4. per turn: target prompt length L ~ context * U(1 - spread, 1 + spread), target hit h from
   the mixture; prefix = min(source_len, round(h * L)) and prompt = round(prefix / h), so the
   ideal hit is exactly h (up to rounding) and the prefix never exceeds the source sequence
   (doc for turn 0, previous prompt + output after that); at least one new token per turn;
5. output: fixed, or lognormal(median, sigma) clipped to [1, output_max];
6. think time before each later turn: exponential with mean `think_mean_s`; the later turn's
   arrival_s = previous arrival_s + nominal_ttft_s + previous output * nominal_tpot_s + think.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pddjax.workload.config import WorkloadConfig
from pddjax.workload.trace import TraceRequest


def doc_tokens(cfg: WorkloadConfig, doc_id: int) -> int:
    """Length of shared context `doc_id` (deterministic in (seed, doc_id))."""
    rng = np.random.default_rng([cfg.seed, 2, doc_id])
    lo, hi = 1 - cfg.context_spread, 1 + cfg.context_spread
    return max(16, int(round(cfg.context_tokens * rng.uniform(lo, hi))))


def _session_starts(cfg: WorkloadConfig) -> list[float]:
    rng = np.random.default_rng([cfg.seed, 0])
    starts, t = [], -cfg.warm_start_s
    while True:
        t += rng.exponential(1.0 / cfg.session_rate)
        if t > cfg.duration_s:
            return starts
        starts.append(t)


def _doc_weights(cfg: WorkloadConfig) -> np.ndarray:
    w = 1.0 / np.arange(1, cfg.n_docs + 1) ** cfg.doc_zipf  # [n_docs]
    return w / w.sum()


def _hit_cdf(cfg: WorkloadConfig) -> list[float]:
    total = sum(w for w, _, _ in cfg.hit_mix)
    cdf, acc = [], 0.0
    for w, _, _ in cfg.hit_mix:
        acc += w / total
        cdf.append(acc)
    return cdf


def _sample_hit(rng: np.random.Generator, cfg: WorkloadConfig, cdf: list[float]) -> float:
    u = rng.random()
    b = next((i for i, c in enumerate(cdf) if u < c), len(cdf) - 1)
    _, lo, hi = cfg.hit_mix[b]
    return lo + (hi - lo) * rng.random()


def _sample_output(rng: np.random.Generator, cfg: WorkloadConfig) -> int:
    if cfg.output_fixed is not None:
        return int(cfg.output_fixed)
    x = cfg.output_median * np.exp(cfg.output_sigma * rng.standard_normal())
    return int(min(cfg.output_max, max(1, round(x))))


def _session(cfg: WorkloadConfig, sid: int, start: float, doc_w: np.ndarray, cdf: list[float],
             until: float) -> list[TraceRequest]:
    rng = np.random.default_rng([cfg.seed, 1, sid])
    turns = min(cfg.turns_max, int(rng.geometric(1.0 / cfg.turns_mean)))
    doc = int(rng.choice(cfg.n_docs, p=doc_w))
    dlen = doc_tokens(cfg, doc)
    seed = int(rng.integers(0, 2**31 - 1))
    lo, hi = 1 - cfg.context_spread, 1 + cfg.context_spread
    source_len, arrival, out, prev_out = dlen, start, [], 0
    for turn in range(turns):
        think = 0.0 if turn == 0 else float(rng.exponential(cfg.think_mean_s))
        if turn:
            arrival += cfg.nominal_ttft_s + prev_out * cfg.nominal_tpot_s + think
        if arrival > until:
            break
        target_len = max(2, int(round(cfg.context_tokens * rng.uniform(lo, hi))))
        h = _sample_hit(rng, cfg, cdf)
        prefix = min(source_len, int(round(h * target_len)))
        prompt = int(round(prefix / h)) if h > 0 else target_len
        prompt = max(prompt, prefix + 1)
        output = _sample_output(rng, cfg)
        kind = "start" if turn == 0 else ("append" if prefix == source_len else "edit")
        out.append(TraceRequest(
            request_id=f"s{sid}-t{turn}", session_id=sid, turn=turn, arrival_s=round(arrival, 6),
            think_s=round(think, 6), doc_id=doc, doc_tokens=dlen, context_seed=seed,
            prefix_tokens=prefix, new_tokens=prompt - prefix, prompt_tokens=prompt,
            output_tokens=output, max_tokens=output, kind=kind,
        ))
        source_len, prev_out = prompt + output, output
    return out


def generate(cfg: WorkloadConfig, until: float = math.inf) -> list[TraceRequest]:
    """The trace of `cfg`, sorted by arrival time; deterministic in `cfg`.

    Turns scheduled after `until` (and the rest of their session) are left out; the
    simulator passes its horizon here to skip work it would not simulate."""
    doc_w, cdf = _doc_weights(cfg), _hit_cdf(cfg)
    reqs: list[TraceRequest] = []
    for sid, start in enumerate(_session_starts(cfg)):
        reqs.extend(_session(cfg, sid, start, doc_w, cdf, until))
    reqs.sort(key=lambda r: (r.arrival_s, r.session_id, r.turn))
    return reqs


def config_dict(cfg: WorkloadConfig) -> dict:
    """JSON-friendly form of a config (for trace headers and reports)."""
    d = dataclasses.asdict(cfg)
    d["hit_mix"] = [list(b) for b in cfg.hit_mix]
    return d
