"""Token sampling whose random draw for output position t depends only on (seed, t).

So any engine that samples position t of a request draws the same token from the same
logits: this is what makes the RLD -> MD handoff exact. Greedy when temperature <= 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def _sample_row(logits, seed, step, temperature, top_k, top_p):
    # logits: [V] float32; scalars per row. No sort over the vocabulary: top-k and top-p
    # thresholds are found by bisection on the float bit patterns (exact, ties kept).
    V = logits.shape[-1]
    greedy = jnp.argmax(logits).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    keys = _float_key(scaled)  # [V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = _largest_threshold(keys, lambda t: jnp.sum(keys >= t) >= k)
    keep = keys >= kth
    probs = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf))  # [V]
    pkeys = _float_key(probs)
    # smallest nucleus: the highest-probability tokens whose mass reaches top_p
    pth = _largest_threshold(pkeys, lambda t: jnp.sum(jnp.where(pkeys >= t, probs, 0.0)) >= top_p * (1 - 1e-6))
    keep = keep & (pkeys >= pth)
    probs = jnp.where(keep, probs, 0.0)
    cdf = jnp.cumsum(probs)  # [V]
    u = jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(seed), step), dtype=jnp.float32)
    sampled = jnp.minimum(jnp.sum(cdf < u * cdf[-1]), V - 1).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def sample(logits, seeds, steps, temperature, top_k, top_p, *, greedy_only: bool = False):
    """logits: [B, V] float32; seeds, steps, top_k: [B] int32; temperature, top_p: [B] float32
    -> tokens [B] int32. `steps[b]` is the output position being sampled (0 = first token).
    `greedy_only` (static) skips the sampling machinery when every row is greedy."""
    if greedy_only:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.vmap(_sample_row)(logits.astype(jnp.float32), seeds, steps, temperature, top_k, top_p)
