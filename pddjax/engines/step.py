"""The one jitted compute entry point of the paged engines: a packed ragged batch in, one
sampled token per row out, the KV pool donated and updated in place.

Static: model config, attention implementation, max row length bucket, greedy fast path.
`compile_count()` reports how many shapes have been compiled, so tests can assert that a
steady workload never recompiles.
"""

from __future__ import annotations

import functools

import jax

from pddjax.model.paged import PackedBatch, forward_paged
from pddjax.model.sampling import sample


@functools.partial(jax.jit, static_argnames=("cfg", "max_q_len", "impl", "greedy", "return_logits"),
                   donate_argnames=("pool",))
def run_step(w, cfg, batch: PackedBatch, pool, seeds, steps, temperature, top_k, top_p, *,
             max_q_len: int, impl: str, greedy: bool, return_logits: bool = False):
    # seeds, steps, top_k: [B] int32; temperature, top_p: [B] float32 -> tokens [B], pool
    logits, pool = forward_paged(w, cfg, batch, pool, max_q_len=max_q_len, impl=impl)  # [B, V]
    tokens = sample(logits, seeds, steps, temperature, top_k, top_p, greedy_only=greedy)
    return tokens, (logits if return_logits else None), pool


def compile_count() -> int:
    """Distinct compiled variants of `run_step` in this process."""
    return run_step._cache_size()
