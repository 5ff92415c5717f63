"""Forward pass over the paged KV pool, for packed ragged batches.

One step serves every kind of row at once: prefill (a prompt, or a chunk of it, after a cached
prefix), multi-token extend (known token IDs, e.g. the RLD handoff) and single-token decode.
Each row's new tokens are written into its pages, then attend causally to everything before
them. Letters: T packed tokens, B rows, MP pages per row, L layers, K kv heads, D head dim.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from pddjax.kv.pool import KVPool
from pddjax.model import layers as nn
from pddjax.model.attention import Ragged, paged_attention
from pddjax.model.config import ModelConfig
from pddjax.model.weights import Weights


@flax.struct.dataclass
class PackedBatch:
    tokens: jax.Array  # [T] int32 token ids (padding: 0)
    positions: jax.Array  # [T] int32 absolute position of each token in its sequence
    slot_pages: jax.Array  # [T] int32 page receiving each token's K/V (padding: page 0)
    slot_offsets: jax.Array  # [T] int32 offset within that page
    cu_q_lens: jax.Array  # [B+1] int32 row r owns tokens cu[r]:cu[r+1]
    kv_lens: jax.Array  # [B] int32 KV length of row r including its new tokens
    page_tables: jax.Array  # [B, MP] int32 (padding: page 0)
    last_idx: jax.Array  # [B] int32 packed index of row r's last token (padding rows: 0)


def forward_paged(w: Weights, cfg: ModelConfig, batch: PackedBatch, pool: KVPool, *,
                  max_q_len: int, impl: str = "xla", mesh=None, kv_sharded: bool = True):
    """-> (logits [B, V] float32 at each row's last token, pool with the new tokens' K/V).

    Per layer, the new tokens' K/V go into their pages, then attention reads the pages
    (Pallas: in place, in the whole pool at layer i, no per-layer slice is materialized;
    XLA has no paged op and gathers each row's pages first: on CPU that
    copy, at this machine's few GB/s, is what decode at large batch pays for). A variant that
    gathered all layers once before the scan measured no faster and needs 30x the memory.

    Tensor parallel (`mesh`: a jax Mesh with one axis, weights and pool placed by
    pddjax/engines/mesh.py): q is pinned to its head split and k, v to the pool's (KV heads
    split when `kv_sharded`, else replicated); GSPMD partitions the rest (one all-reduce after
    the attention output and one after the MLP per layer)."""
    h = nn.embed(w, batch.tokens)  # [T, E]
    rows = Ragged(batch.cu_q_lens, batch.kv_lens, batch.page_tables, max_q_len, cfg.head_dim**-0.5)

    def layer_step(carry, xs):
        h, kp, vp = carry  # kp, vp: [L, K, P, S, D]
        layer, i = xs
        q, k, v = nn.qkv(layer, h, batch.positions, cfg)  # [T, H, D], [T, K, D], [T, K, D]
        if mesh is not None:
            q = _pin(q, mesh, True)
            k, v = _pin(k, mesh, kv_sharded), _pin(v, mesh, kv_sharded)
        # x[i, :, pages, offsets] puts the token axis first: value [T, K, D]
        kp = kp.at[i, :, batch.slot_pages, batch.slot_offsets].set(k.astype(kp.dtype))
        vp = vp.at[i, :, batch.slot_pages, batch.slot_offsets].set(v.astype(vp.dtype))
        if mesh is not None:  # the pool stays as placed (GSPMD would re-split a replicated one)
            kp, vp = _pin(kp, mesh, kv_sharded), _pin(vp, mesh, kv_sharded)
        o = paged_attention(q, kp, vp, rows, impl=impl, layer=i, mesh=mesh, kv_sharded=kv_sharded)  # [T, H, D]
        h = nn.attn_out(layer, h, o)
        h = nn.mlp(layer, h, cfg)
        return (h, kp, vp), None

    if (impl == "native" and mesh is None and batch.tokens.shape[0] <= nn.IN_PLACE_MAX_TOKENS
            and nn.in_place_ok(w.layers)):
        # few tokens on CPU: the products read the stacked weights in place (no per-layer slice copy)
        (h, kp, vp), _ = jax.lax.scan(lambda c, i: layer_step(c, (nn.layer_in_place(w.layers, i), i)),
                                      (h, pool.k, pool.v), jnp.arange(cfg.num_layers))
    else:
        (h, kp, vp), _ = jax.lax.scan(layer_step, (h, pool.k, pool.v), (w.layers, jnp.arange(cfg.num_layers)))
    logits = nn.logits(w, h[batch.last_idx], cfg)  # [B, V]
    if mesh is not None and cfg.vocab_size % mesh.size == 0:  # split over vocab like the LM head, so
        logits = _pin(logits, mesh, True)  # the logits are gathered (B x V), not the head (E x V)
    return logits, KVPool(kp, vp)


def _pin(x, mesh, split: bool):
    """x [T, N, ...] constrained to its axis 1 (heads, vocab) split over the mesh's axis (or replicated)."""
    from jax.sharding import NamedSharding, PartitionSpec

    spec = PartitionSpec(None, mesh.axis_names[0]) if split else PartitionSpec()
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
