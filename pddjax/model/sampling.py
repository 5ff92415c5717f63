"""Token sampling whose random draw for output position t depends only on (seed, t): Gumbel
noise per vocabulary entry from (seed, t), added to the scaled logits, argmax (`sample`).

So any engine that samples position t of a request draws the same token from the same
logits: this is what makes the RLD -> MD handoff exact. Greedy when temperature <= 0.

`sample_step` is the paged step's whole sampler: penalties and logit bias (penalties.py) on
the rows that use them, then the allowed-token mask of constrained rows (token_mask.py), then
greedy or the draw, then the logprobs of the raw logits; each part is skipped by `lax.cond`
when no row of the batch needs it (the mask: when every word is all ones, no row constrained).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pddjax.model import penalties, token_mask
from pddjax.model.sampling_params import MAX_TOP_LOGPROBS

TOP_LOGPROBS = MAX_TOP_LOGPROBS  # alternatives a step returns per row (callers slice to top_logprobs)


def _float_key(x):
    """Monotone map float32 -> int32 (a < b iff key(a) < key(b)), for exact bisection."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(i < 0, jnp.int32(-(2**31)) - i - 1, i)


def _largest_threshold(keys, ok):
    """Largest int32 t with ok(t) true, where ok is monotone (true ... true false ... false)
    over [min(keys), max(keys)] and ok(min(keys)) holds. 32 halvings, no sort."""
    lo = jnp.min(keys)
    hi = jnp.max(keys)

    def body(_, lh):
        lo, hi = lh
        # ceil((lo + hi) / 2) without int32 overflow: lo = 2a + r1, hi = 2b + r2
        mid = (lo >> 1) + (hi >> 1) + (((lo & 1) + (hi & 1) + 1) >> 1)
        good = ok(mid)
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid - 1)

    lo, hi = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return lo


def _kept(scaled, top_k, top_p):
    # scaled: [V] float32 (logits / temperature); scalars per row -> [V] bool, the tokens top-k
    # and top-p keep. No sort over the vocabulary: both thresholds are found by bisection on the
    # float bit patterns (exact, ties kept).
    V = scaled.shape[-1]
    keys = _float_key(scaled)  # [V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = _largest_threshold(keys, lambda t: jnp.sum(keys >= t) >= k)
    keep = keys >= kth
    probs = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf))  # [V]
    pkeys = _float_key(probs)
    # smallest nucleus: the highest-probability tokens whose mass reaches top_p
    pth = _largest_threshold(pkeys, lambda t: jnp.sum(jnp.where(pkeys >= t, probs, 0.0)) >= top_p * (1 - 1e-6))
    return keep & (pkeys >= pth)


def _gumbel(seed, step, V: int):
    """[V] float32 Gumbel noise of output position `step` under `seed`."""
    return jax.random.gumbel(jax.random.fold_in(jax.random.PRNGKey(seed), step), (V,), jnp.float32)


def argmax(x):
    """x: [B, V] -> [B] int32, each row's first index of its largest value: `jnp.argmax`'s answer
    from two plain reductions (the max, then the smallest index holding it), which XLA:CPU
    vectorizes; its fused (value, index) reduction ran ~10x slower here ([32, 49152]: 11.8 ms
    against 1.3; [64, 512]: 330 us against 30). A row with NaN gets V - 1 (never out of range)."""
    V = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)  # [B, 1]
    first = jnp.min(jnp.where(x == top, jnp.arange(V, dtype=jnp.int32), V), axis=-1)  # [B]
    return jnp.minimum(first, V - 1)


def sample(logits, seeds, steps, temperature, top_k, top_p, *, greedy_only: bool = False):
    """logits: [B, V] float32; seeds, steps, top_k: [B] int32; temperature, top_p: [B] float32
    -> tokens [B] int32. `steps[b]` is the output position being sampled (0 = first token).
    `greedy_only` (static) skips the sampling machinery when every row is greedy.

    Gumbel-max: argmax(logits / temperature + g) over the kept tokens, g iid Gumbel per token
    from (seed, step), draws from their softmax. The draw changes with the logits only where the
    two largest perturbed scores are closer than the logits' change, so a last-bit difference
    (another step shape's summation order) keeps the token in all but ~1e-4 of draws; an
    inverse-CDF draw over the cumulative sum changed in ~1 in 70 (tests/model/test_sampling.py).
    The top-k / top-p bisection runs only in steps where some row filters (`lax.cond`)."""
    if greedy_only:
        return argmax(logits)
    B, V = logits.shape
    logits = logits.astype(jnp.float32)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]  # [B, V]
    keep = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1.0)), lambda: jax.vmap(_kept)(scaled, top_k, top_p),
                        lambda: jnp.ones((B, V), bool))  # [B, V]
    noise = jax.vmap(lambda seed, step: _gumbel(seed, step, V))(seeds, steps)  # [B, V]
    sampled = argmax(jnp.where(keep, scaled + noise, -jnp.inf))
    return jnp.where(temperature > 0, sampled, argmax(logits))


def logprobs(logits, tokens):
    """logits: [B, V] (raw: before penalties, bias and temperature), tokens: [B] int32 ->
    (logprob of each token [B] float32, top ids [B, 20] int32, their logprobs [B, 20] float32)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, V]
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    top_vals, top_ids = jax.lax.top_k(lp, TOP_LOGPROBS)
    return chosen, top_ids.astype(jnp.int32), top_vals


def no_logprobs(B: int):
    """`logprobs`' outputs when no row asks: zeros of the same shapes."""
    return (jnp.zeros((B,), jnp.float32), jnp.zeros((B, TOP_LOGPROBS), jnp.int32),
            jnp.zeros((B, TOP_LOGPROBS), jnp.float32))


def sample_step(logits, tables, sampling: tuple, greedy):
    """The paged step's sampler. logits: [B, V]; tables: penalties.Tables or None (no penalty
    state: a multi-host instance); sampling: (seeds, steps, temperature, top_k, top_p, pen_row,
    presence, frequency, repetition, want_logprobs, mask), each [B] (int32: seeds, steps, top_k,
    pen_row (-1: none); bool: want_logprobs; float32 the rest) but mask, int32 [B, ceil(V / 32)]
    (token_mask.py; all ones: unconstrained; may be left out); greedy: [] bool (every sampling row greedy) ->
    (tokens [B] int32, `logprobs` outputs, tables with the sampled tokens counted)."""
    seeds, steps, temperature, top_k, top_p, pen_row, presence, frequency, repetition, want, *mask = sampling
    raw = logits.astype(jnp.float32)  # [B, V]
    x = raw
    if tables is not None:
        x = jax.lax.cond(jnp.any(pen_row >= 0),
                         lambda: penalties.apply_rows(raw, tables, pen_row, presence, frequency, repetition),
                         lambda: raw)
    # the token mask (constrained decoding): after penalties and bias, before the temperature,
    # top-k and top-p of the draw, on greedy rows too
    if mask:  # (a caller without constrained rows may leave it out)
        x = jax.lax.cond(jnp.any(mask[0] != token_mask.ALL), token_mask.apply, lambda lg, _: lg, x, mask[0])
    sp = (seeds, steps, temperature, top_k, top_p)
    tokens = jax.lax.cond(greedy, lambda lg: sample(lg, *sp, greedy_only=True), lambda lg: sample(lg, *sp), x)
    lp = jax.lax.cond(jnp.any(want), lambda: logprobs(raw, tokens), lambda: no_logprobs(raw.shape[0]))
    if tables is not None:
        tables = penalties.record(tables, pen_row, tokens)
    return tokens, lp, tables
