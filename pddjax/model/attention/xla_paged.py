"""Paged attention in plain jnp: the reference the Pallas kernel is checked against.

Queries of all rows are packed along tokens; the XLA version gathers them into a padded
[B, max_q_len] block and each row's KV pages into one contiguous [B, MP*S] run, then does
dense masked attention. Simple and fast enough on CPU; memory is O(B * MP * S) per layer.
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
    # q: [T, H, D]; k_pages, v_pages: [KH, P, S, D]  ->  out: [T, H, D] in q.dtype
    page_tables = rows.page_tables  # [B, MP]
    num_kv_heads, _, page_size, head_dim = k_pages.shape
    num_rows, max_pages = page_tables.shape
    # Per-row contiguous KV: [KH, B, MP, S, D] -> [KH, B, MP*S, D]. jnp.take lowers to one
    # slab-copying gather; k_pages[:, page_tables] is ~6x slower on CPU.
    shape = (num_kv_heads, num_rows, max_pages * page_size, head_dim)
    k_rows = jnp.take(k_pages, page_tables, axis=1).reshape(shape).transpose(1, 0, 2, 3)  # BKCD
    v_rows = jnp.take(v_pages, page_tables, axis=1).reshape(shape).transpose(1, 0, 2, 3)
    return rows_attention(q, k_rows, v_rows, rows)


def rows_attention(q: jax.Array, k_rows: jax.Array, v_rows: jax.Array, rows: Ragged) -> jax.Array:
    """Attention of packed queries over per-row contiguous KV (rows.page_tables unused).

    q: [T, H, D]; k_rows, v_rows: [B, KH, C, D] (row r's positions 0..C-1; row-major, so the
    batched matmuls need no transposes on CPU) -> [T, H, D] in q.dtype."""
    cu_q_lens, kv_lens, max_q_len, sm_scale = rows.cu_q_lens, rows.kv_lens, rows.max_q_len, rows.sm_scale
    num_tokens, num_heads, head_dim = q.shape
    num_rows, num_kv_heads, max_kv, _ = k_rows.shape
    group = num_heads // num_kv_heads

    idx, q_valid = row_token_index(cu_q_lens, max_q_len)  # [B, Q]
    q_blk = q[jnp.clip(idx, 0, num_tokens - 1)]  # [B, Q, H, D]
    q_blk = q_blk.reshape(num_rows, max_q_len, num_kv_heads, group, head_dim)  # BQKGD

    # logits: 'bqkgd,bksd->bkgqs' (K = kv head, G = query heads sharing it), float32
    logits = jnp.einsum(
        "bqkgd,bksd->bkgqs", q_blk, k_rows, preferred_element_type=jnp.float32,
        precision=lax.Precision.HIGHEST,  # no TF32 on GPU: this is the reference
    ) * sm_scale

    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [B]
    q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(max_q_len)[None, :]  # [B, Q]
    k_pos = jnp.arange(max_kv)  # [S_all]
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]  # [B, Q, S_all]
    mask = mask[:, None, None]  # [B, 1, 1, Q, S_all]

    logits = jnp.where(mask, logits, MASK_VALUE)
    m = logits.max(axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)  # [B, KH, G, Q, S_all]
    denom = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)  # fully masked (padding) rows -> zeros

    # out: 'bkgqs,bksd->bqkgd', float32
    out = jnp.einsum("bkgqs,bksd->bqkgd", p, v_rows.astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
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
