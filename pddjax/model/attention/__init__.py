"""Attention over the paged KV pool: one entry point, two implementations.

Layout (one layer): k_pages, v_pages [KH, P, S, D], page 0 is scratch; q [T, H, D] packed
over rows with cu_q_lens [B+1]; kv_lens [B] include the new tokens (already written);
page_tables [B, MP] padded with 0. Query i of row r sits at kv_lens[r] - q_len[r] + i.
"""

from __future__ import annotations

import jax

from pddjax.model.attention.xla_paged import paged_attention_xla, write_kv

IMPLS = ("xla", "pallas")


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    page_tables: jax.Array,
    *,
    max_q_len: int,
    sm_scale: float,
    impl: str = "xla",
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """[T, H, D] attention output in q.dtype; padding tokens give zeros.

    With `layer`, k_pages/v_pages are the whole pool [L, KH, P, S, D]: Pallas reads that
    layer's pages in place; XLA slices the layer out first."""
    if layer is not None and impl == "xla":
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    if impl == "xla":
        return paged_attention_xla(
            q, k_pages, v_pages, cu_q_lens, kv_lens, page_tables,
            max_q_len=max_q_len, sm_scale=sm_scale,
        )
    if impl == "pallas":
        from pddjax.model.attention.pallas_paged import paged_attention_pallas

        return paged_attention_pallas(
            q, k_pages, v_pages, cu_q_lens, kv_lens, page_tables,
            max_q_len=max_q_len, sm_scale=sm_scale, layer=layer,
        )
    raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")


def default_impl(backend: str | None = None) -> str:
    """XLA on CPU (interpret-mode Pallas is slow); Pallas on GPU/TPU."""
    backend = backend or jax.default_backend()
    return "xla" if backend == "cpu" else "pallas"


__all__ = ["IMPLS", "default_impl", "paged_attention", "write_kv"]
