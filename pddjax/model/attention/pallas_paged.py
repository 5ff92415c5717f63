"""Ragged paged attention in Pallas: one kernel for prefill, chunked prefill, extend and decode.

Rows of different kinds share one call. The wrapper gathers each row's packed queries into a
padded [B, Qp] block and folds the query heads that share a KV head into the row dimension:

  q [T, H, D] -> [B, Qp, KH, Gp, D] -> [B, KH*n_sub, Qp*hps, D]

where hps ("heads per step") query heads ride along each query token (Gp = n_sub * hps >= G,
padded with zero heads when G is not a multiple; G = 3 with hps = 4 pads one head). One grid
step is (row b, query block qb, head slot h, kv split s): a [block_q * hps, D] query tile
against kv head h // n_sub. So with hps = next_pow2(G) every KV page is read once per (row, q block), not once
per query head: GQA without copying or re-reading KV. Tile dims are powers of two (Triton);
head counts (9 q / 3 kv) never are, so heads are never a block dim of the pool.

Inside a step, `lax.fori_loop` walks the row's page table in page-aligned KV blocks of
`pages_per_block` pages with an online softmax (float32 m, l, acc). The trip count comes from
the row's lengths: cdiv(last causal position + 1, block_kv), 0 for query blocks past q_len, so
there is no data-dependent Python control flow. The mask is causal with offset kv_len - q_len;
masked probabilities are set to 0 explicitly, so padding rows come out as exact zeros.

KV splits (flash-decoding): a decode batch has only B * KH tiles, too few to fill a GPU, so
`kv_splits` > 1 gives each tile's KV blocks to several grid steps; each writes a partial
(out, m, l) and the wrapper merges them in float32. With kv_splits = 1 the kernel writes the
final output directly.

KV write: NOT fused. The new tokens' K/V are written by `write_kv` before the call. Fusing
would race: in a chunked prefill, query block qb attends to keys of the new tokens of blocks
< qb, which other, concurrently running grid steps would be writing (a GPU grid has no
barrier); avoiding that means a second K/V source in the inner loop for every block. The
saving is small: the write is T*KH*D elements, while attention reads sum(kv_len)*KH*D (a
decode step over 256-token contexts writes 1/256 of what it reads), and XLA already fuses
the scatter with the K/V projection that produces it.

Backends (`choose_blocks` is the one place block sizes are picked):
  cpu  -> interpret=True (tests); few, large grid steps because interpret cost is per step.
  gpu  -> Triton: tiles >= 16 rows and >= 16 KV tokens for tl.dot, num_warps / num_stages.
  tpu  -> same kernel; sublane/lane-friendly tiles (8 rows, 128 KV tokens). The pool is a
          whole-array block here (as in JAX's own GPU paged attention); a production TPU
          build would place it in pl.ANY and DMA the page block in `_load_kv_block`, the
          only function that touches the pool.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pddjax.model.attention.ragged import Ragged
from pddjax.model.attention.xla_paged import MASK_VALUE, pack_rows, row_token_index
from pddjax.sizes import pow2_at_least

# float32 operands are multiplied as float32 (Triton's default would be TF32, ~1e-3 error);
# bf16 operands are exact products either way.
_EXACT = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Blocks:
    block_q: int  # query tokens per grid step (power of two)
    heads_per_step: int  # query heads folded into the tile rows (power of two)
    pages_per_block: int  # KV pages per inner-loop step (power of two)
    kv_splits: int = 1  # grid steps sharing one tile's KV blocks (merged in the wrapper)
    num_warps: int | None = None  # Triton only
    num_stages: int | None = None  # Triton only


GPU_SMS = 132  # H100 / H200; only used to size kv splits, so being off by a bit is harmless


def choose_blocks(
    backend: str, *, page_size: int, group: int, max_q_len: int, head_dim: int,
    num_rows: int = 1, num_kv_heads: int = 1, max_pages: int = 1,
) -> Blocks:
    """Block sizes per backend; the only place they are chosen."""
    hps = pow2_at_least(group)
    want_q = pow2_at_least(max_q_len)
    if backend in ("gpu", "cuda", "rocm"):
        # tl.dot needs M, N, K >= 16; keep the tile at <= 128 rows of f32 accumulators.
        block_q = min(max(want_q, max(1, 16 // hps)), max(1, 128 // hps))
        ppb = max(1, 64 // page_size)
        # Split KV until there are ~2 waves of programs (decode: B * KH tiles are few).
        tiles = num_rows * -(-max_q_len // block_q) * num_kv_heads * -(-group // hps)
        splits = max(1, min(-(-max_pages // ppb), -(-2 * GPU_SMS // tiles)))
        return Blocks(block_q, hps, ppb, splits, num_warps=4 if head_dim <= 64 else 8, num_stages=2)
    if backend == "tpu":
        block_q = min(max(want_q, max(1, 8 // hps)), max(1, 256 // hps))
        return Blocks(block_q, hps, max(1, 128 // page_size))  # megacore: rows suffice
    # cpu / interpret: cost is per grid step and per loop trip, so use big tiles.
    block_q = min(want_q, max(1, 64 // hps))
    return Blocks(block_q, hps, max(1, 64 // page_size))


def _load_kv_block(k_ref, v_ref, layer, head, pages, page_size, head_dim):
    # layer: [] ; head: [] or None; pages: [ppb] page ids -> k, v: [ppb * S, D] (gather from the
    # kv head's pool; with `head`, k_ref / v_ref hold every kv head and `head` picks one)
    n = pages.shape[0] * page_size
    if head is not None:
        return k_ref[layer, head, pages].reshape(n, head_dim), v_ref[layer, head, pages].reshape(n, head_dim)
    return k_ref[layer, pages].reshape(n, head_dim), v_ref[layer, pages].reshape(n, head_dim)


def _kernel(*refs, sm_scale: float, blocks: Blocks, page_size: int, blocks_per_split: int,
            with_head: bool = False):
    # refs: q_len, kv_len, layer [1], (with_head: head [1], the kv head every query head of this
    # call reads), page table [MPp], q [R, D] (R = block_q * hps), k, v [L, P, S, D] (one kv head's
    # pool, every layer; with_head: [L, KH, P, S, D], all of them), o [R, D], (kv_splits > 1: m, l [R])
    head_ref = None
    if with_head:
        q_len_ref, kv_len_ref, layer_ref, head_ref, pt_ref, q_ref, k_ref, v_ref, o_ref, *ml_refs = refs
    else:
        q_len_ref, kv_len_ref, layer_ref, pt_ref, q_ref, k_ref, v_ref, o_ref, *ml_refs = refs
    rows, head_dim = q_ref.shape
    bq, hps, ppb = blocks.block_q, blocks.heads_per_step, blocks.pages_per_block
    block_kv = ppb * page_size
    qb = pl.program_id(1)
    q_len, kv_len, layer = q_len_ref[0], kv_len_ref[0], layer_ref[0]
    head = None if head_ref is None else head_ref[0]

    q = q_ref[...]
    tok = qb * bq + lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // hps  # [R, 1]
    q_pos = kv_len - q_len + tok  # [R, 1] absolute position of each tile row
    row_valid = tok < q_len  # [R, 1]
    # Last KV position any row of this tile may see; no KV blocks for tiles past q_len.
    last = kv_len - q_len + jnp.minimum(qb * bq + bq, q_len) - 1
    num_kv_blocks = jnp.where(qb * bq < q_len, (last + block_kv) // block_kv, 0)

    def body(j, carry):
        acc, m, l_sum = carry  # [R, D], [R], [R] float32 (running sum of exp)
        pages = pt_ref[pl.ds(j * ppb, ppb)]  # [ppb]
        k, v = _load_kv_block(k_ref, v_ref, layer, head, pages, page_size, head_dim)  # [BK, D]
        # 'rd,kd->rk'
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_EXACT,
                            preferred_element_type=jnp.float32) * sm_scale  # [R, BK]
        k_pos = j * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        mask = (k_pos <= q_pos) & row_valid  # [R, BK]
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        l_sum = alpha * l_sum + p.sum(axis=1)
        # 'rk,kd->rd'
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=_EXACT,
                             preferred_element_type=jnp.float32)
        return alpha[:, None] * acc + pv, m_new, l_sum

    init = (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    first = pl.program_id(3) * blocks_per_split
    last_block = jnp.minimum(first + blocks_per_split, num_kv_blocks)
    acc, m, l_sum = lax.fori_loop(first, jnp.maximum(first, last_block), body, init)
    l2 = l_sum[:, None]
    o_ref[...] = jnp.where(l2 > 0, acc / jnp.where(l2 > 0, l2, 1.0), 0.0).astype(o_ref.dtype)
    if ml_refs:  # partial result of one kv split: out normalized by its own l, plus m and l
        ml_refs[0][...] = m
        ml_refs[1][...] = l_sum


def paged_attention_pallas(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    rows: Ragged,
    *,
    layer: jax.Array | int | None = None,
    blocks: Blocks | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    kv_head: jax.Array | int | None = None,
) -> jax.Array:
    # q: [T, H, D]; k_pages, v_pages: [KH, P, S, D], or the whole pool [L, KH, P, S, D] with
    # `layer` (a traced scalar is fine): the kernel then reads that layer's pages in place, so
    # a per-layer slice of the pool (a copy of it) is never made  ->  [T, H, D] in q.dtype
    # (padding tokens: zeros). kv_head (a traced scalar is fine): every query head reads that
    # one KV head of the pool, in place (a tensor-parallel shard of a replicated pool: its
    # query heads share one KV head).
    cu_q_lens, kv_lens, page_tables = rows.cu_q_lens, rows.kv_lens, rows.page_tables  # [B+1], [B], [B, MP]
    max_q_len, sm_scale = rows.max_q_len, rows.sm_scale
    if k_pages.ndim == 4:  # one layer: a free leading axis
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    elif layer is None:
        raise ValueError("a 5-D KV pool [L, KH, P, S, D] needs `layer`")
    num_tokens, num_heads, head_dim = q.shape
    num_layers, pool_kv_heads, num_pages, page_size, _ = k_pages.shape
    num_kv_heads = pool_kv_heads if kv_head is None else 1  # kv heads this call's query heads read
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    num_rows, max_pages = page_tables.shape
    group = num_heads // num_kv_heads
    backend = backend or jax.default_backend()
    if interpret is None:
        interpret = backend not in ("gpu", "cuda", "rocm", "tpu")
    blocks = blocks or choose_blocks(backend, page_size=page_size, group=group,
                                     max_q_len=max_q_len, head_dim=head_dim, num_rows=num_rows,
                                     num_kv_heads=num_kv_heads, max_pages=max_pages)
    bq, hps, ppb = blocks.block_q, blocks.heads_per_step, blocks.pages_per_block
    n_sub = -(-group // hps)  # head slots per kv head
    g_pad = n_sub * hps
    num_q_blocks = -(-max_q_len // bq)
    q_pad = num_q_blocks * bq
    rows = bq * hps

    # Gather queries: [B, Qp, KH, Gp, D] -> [B, KH*n_sub, Qp*hps, D]
    idx, _ = row_token_index(cu_q_lens, q_pad)
    qb = q[jnp.clip(idx, 0, num_tokens - 1)].reshape(num_rows, q_pad, num_kv_heads, group, head_dim)
    qb = jnp.pad(qb, ((0, 0), (0, 0), (0, 0), (0, g_pad - group), (0, 0)))
    qb = qb.reshape(num_rows, q_pad, num_kv_heads, n_sub, hps, head_dim)
    qb = qb.transpose(0, 2, 3, 1, 4, 5).reshape(num_rows, num_kv_heads * n_sub, q_pad * hps, head_dim)

    splits = blocks.kv_splits
    kv_blocks = -(-max_pages // ppb)  # per-row capacity in KV blocks
    per_split = -(-kv_blocks // splits)
    mp_pad = kv_blocks * ppb
    pt = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, mp_pad - max_pages)))  # -> scratch
    q_lens = (cu_q_lens[1:] - cu_q_lens[:-1]).astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)

    compiler_params = None
    if not interpret and backend in ("gpu", "cuda", "rocm"):
        from jax.experimental.pallas import triton as plgpu

        compiler_params = plgpu.CompilerParams(num_warps=blocks.num_warps,
                                               num_stages=blocks.num_stages)
    kernel = functools.partial(_kernel, sm_scale=sm_scale, blocks=blocks, page_size=page_size,
                               blocks_per_split=per_split, with_head=kv_head is not None)
    o_spec = pl.BlockSpec((None, None, None, rows, head_dim), lambda b, i, h, s: (s, b, h, i, 0))
    o_shape = jax.ShapeDtypeStruct((splits,) + qb.shape, q.dtype if splits == 1 else jnp.float32)
    out_specs, out_shape = o_spec, o_shape
    if splits > 1:
        ml_spec = pl.BlockSpec((None, None, None, rows), lambda b, i, h, s: (s, b, h, i))
        ml_shape = jax.ShapeDtypeStruct((splits,) + qb.shape[:-1], jnp.float32)
        out_specs, out_shape = [o_spec, ml_spec, ml_spec], [o_shape, ml_shape, ml_shape]
    scalar = pl.BlockSpec((1,), lambda b, i, h, s: (0,))
    if kv_head is None:  # each grid step sees its kv head's pool
        pool_spec = pl.BlockSpec((num_layers, None, num_pages, page_size, head_dim),
                                 lambda b, i, h, s: (0, h // n_sub, 0, 0, 0))
        head_in, head_args = [], ()
    else:  # every kv head's pool; the kernel picks `kv_head`
        pool_spec = pl.BlockSpec((num_layers, pool_kv_heads, num_pages, page_size, head_dim),
                                 lambda b, i, h, s: (0, 0, 0, 0, 0))
        head_in, head_args = [scalar], (jnp.asarray(kv_head, jnp.int32).reshape(1),)
    res = pl.pallas_call(
        kernel,
        grid=(num_rows, num_q_blocks, num_kv_heads * n_sub, splits),
        in_specs=[
            pl.BlockSpec((1,), lambda b, i, h, s: (b,)),  # q_lens
            pl.BlockSpec((1,), lambda b, i, h, s: (b,)),  # kv_lens
            scalar,  # layer
            *head_in,  # kv_head
            pl.BlockSpec((None, mp_pad), lambda b, i, h, s: (b, 0)),  # page table row
            pl.BlockSpec((None, None, rows, head_dim), lambda b, i, h, s: (b, h, i, 0)),  # q tile
            pool_spec,  # k pool
            pool_spec,  # v pool
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=compiler_params,
        name="ragged_paged_attention",
    )(q_lens, kv_lens, layer, *head_args, pt, qb, k_pages, v_pages)
    if splits == 1:
        out = res[0]
    else:  # merge kv splits: weights l_s * exp(m_s - max m), float32
        o_parts, m_parts, l_parts = res  # [NS, B, HS, R, D], [NS, B, HS, R] x2
        w = l_parts * jnp.exp(m_parts - m_parts.max(axis=0, keepdims=True))
        total = w.sum(axis=0)
        out = (w[..., None] * o_parts).sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
        out = out.astype(q.dtype)

    # Unfold: [B, KH*n_sub, Qp*hps, D] -> [B, Qp, KH, Gp, D] -> drop padded heads -> [T, H, D]
    out = out.reshape(num_rows, num_kv_heads, n_sub, q_pad, hps, head_dim)
    out = out.transpose(0, 3, 1, 2, 4, 5).reshape(num_rows, q_pad, num_kv_heads, g_pad, head_dim)
    out = out[:, :, :, :group].reshape(num_rows, q_pad, num_heads, head_dim)
    return pack_rows(cu_q_lens, out, num_tokens)
