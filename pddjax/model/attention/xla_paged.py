"""Paged attention in plain jnp: the reference the Pallas kernel is checked against.

Queries of all rows are packed along tokens; the XLA version gathers them into a padded
[B, max_q_len] block and each row's KV pages into a [KH, B, MP, S, D] copy, then does dense
masked attention. Memory is O(B * MP * S) per layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pddjax.model.attention.ragged import Ragged

# Large finite negative: masked logits never produce inf - inf = nan.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def row_token_index(cu_q_lens: jax.Array, max_q_len: int) -> tuple[jax.Array, jax.Array]:
    """[B, max_q_len] packed-token index of query i of row r, and whether it exists."""
    # cu_q_lens: [B+1]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [B]
    i = jnp.arange(max_q_len, dtype=jnp.int32)  # [Q]
    idx = cu_q_lens[:-1, None] + i[None, :]  # [B, Q]
    return idx, i[None, :] < q_lens[:, None]


def token_row_index(cu_q_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each packed token t: (row r, index i within the row, is-real-token)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    num_rows = cu_q_lens.shape[0] - 1
    r = jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1  # [T]
    r = jnp.clip(r, 0, num_rows - 1)
    return r, t - cu_q_lens[r], t < cu_q_lens[-1]


def pack_rows(cu_q_lens: jax.Array, x_blk: jax.Array, num_tokens: int) -> jax.Array:
    """Inverse of the row gather: [B, Q, ...] padded rows -> [T, ...] packed; padding -> 0."""
    r, i, real = token_row_index(cu_q_lens, num_tokens)
    i = jnp.clip(i, 0, x_blk.shape[1] - 1)
    out = x_blk[r, i]  # [T, ...]
    real = real.reshape(real.shape + (1,) * (out.ndim - 1))
    return jnp.where(real, out, jnp.zeros_like(out))


def paged_attention_xla(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, rows: Ragged) -> jax.Array:
    """q: [T, H, D]; k_pages, v_pages: [KH, P, S, D] -> out: [T, H, D] in q.dtype.

    Each row's pages are gathered as the pool lays them out, [KH, B, MP, S, D] (one copy of
    B x MP pages per layer, no transpose), and both products contract over (page, slot) in that
    layout: XLA:CPU then hands them to its batched-matmul library without relaying the gathered
    KV. (Gathered then transposed to [B, KH, MP*S, D], the real model's whole step ran 1.1-1.2x
    slower at 8-32 decode rows, 1.2x for a 64-token extend, 1.45x for a 512-token prefill.)"""
    cu_q_lens, kv_lens, max_q_len, sm_scale = rows.cu_q_lens, rows.kv_lens, rows.max_q_len, rows.sm_scale
    page_tables = rows.page_tables  # [B, MP]
    num_kv_heads, _, page_size, head_dim = k_pages.shape
    num_rows, max_pages = page_tables.shape
    num_tokens, num_heads, _ = q.shape
    group = num_heads // num_kv_heads
    max_kv = max_pages * page_size
    k_rows = jnp.take(k_pages, page_tables, axis=1)  # [KH, B, MP, S, D]
    v_rows = jnp.take(v_pages, page_tables, axis=1)

    idx, q_valid = row_token_index(cu_q_lens, max_q_len)  # [B, Q]
    q_blk = q[jnp.clip(idx, 0, num_tokens - 1)]  # [B, Q, H, D]
    # [B, KH, X, D] with X = (G, Q): the query heads sharing a kv head and their tokens, one axis
    q_blk = q_blk.reshape(num_rows, max_q_len, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    q_blk = q_blk.reshape(num_rows, num_kv_heads, group * max_q_len, head_dim)

    hi = lax.Precision.HIGHEST  # no TF32 on GPU: this is the reference
    if max_q_len == 1:  # decode: the gathered K is the products' left operand, as laid out
        logits = jnp.einsum("kbmsd,bkxd->bkmsx", k_rows, q_blk, preferred_element_type=jnp.float32,
                            precision=hi)  # [B, KH, MP, S, G]
        logits = logits.reshape(num_rows, num_kv_heads, max_kv, group, 1).transpose(0, 1, 3, 4, 2)
    else:  # several tokens a row: q on the left ([X, D] x [C, D]^T per row and kv head)
        logits = jnp.einsum("bkxd,kbmsd->bkxms", q_blk, k_rows, preferred_element_type=jnp.float32,
                            precision=hi).reshape(num_rows, num_kv_heads, group, max_q_len, max_kv)
    logits = logits * sm_scale  # [B, KH, G, Q, C] float32

    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [B]
    q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(max_q_len)[None, :]  # [B, Q]
    k_pos = jnp.arange(max_kv)  # [C]
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]  # [B, Q, C]
    mask = mask[:, None, None]  # [B, 1, 1, Q, C]

    logits = jnp.where(mask, logits, MASK_VALUE)
    m = logits.max(axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)  # [B, KH, G, Q, C]
    denom = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)  # fully masked (padding) rows -> zeros
    p = p.reshape(num_rows, num_kv_heads, group * max_q_len, max_pages, page_size)  # [B, KH, X, MP, S]

    out = jnp.einsum("bkxms,kbmsd->bkxd", p, v_rows.astype(jnp.float32), precision=hi)  # [B, KH, X, D] float32
    out = out.reshape(num_rows, num_kv_heads, group, max_q_len, head_dim).transpose(0, 3, 1, 2, 4)
    out = out.reshape(num_rows, max_q_len, num_heads, head_dim).astype(q.dtype)
    return pack_rows(cu_q_lens, out, num_tokens)  # [T, H, D]


def write_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_pages: jax.Array,
    slot_offsets: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter new tokens' K/V into their pages; returns new pools (inputs are not mutated).

    Padding tokens should target page 0 (scratch); their writes collide there harmlessly.
    """
    # k_pages, v_pages: [KH, P, S, D]; k_new, v_new: [T, KH, D]; slot_pages, slot_offsets: [T]
    k_pages = k_pages.at[:, slot_pages, slot_offsets].set(
        k_new.transpose(1, 0, 2).astype(k_pages.dtype)  # [KH, T, D]
    )
    v_pages = v_pages.at[:, slot_pages, slot_offsets].set(
        v_new.transpose(1, 0, 2).astype(v_pages.dtype)
    )
    return k_pages, v_pages
