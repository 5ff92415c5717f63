"""Forward pass over a dense KV cache: the simplest correct attention, used by the
monolithic reference engine that every paged/disaggregated path must reproduce.

Letters: B rows, T new tokens per row, C cache length, L layers, K kv heads, G = H/K, D head dim.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from pddjax.model import layers as nn
from pddjax.model.config import ModelConfig
from pddjax.model.weights import Weights


@flax.struct.dataclass
class DenseKV:
    k: jax.Array  # [L, B, C, K, D]
    v: jax.Array  # [L, B, C, K, D]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype) -> DenseKV:
        shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def dense_attention(q, k, v, q_pos, sm_scale: float):
    """q: [B, T, H, D]; k, v: [B, C, K, D]; q_pos: [B, T] -> [B, T, H, D].

    Query at position p attends to cache slots 0..p (slots past p may hold stale data)."""
    B, T, H, D = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, D).astype(jnp.float32)
    s = jnp.einsum("btkgd,bckd->bkgtc", qg, k.astype(jnp.float32)) * sm_scale  # [B, K, G, T, C]
    slots = jnp.arange(k.shape[1])
    mask = slots[None, None, :] <= q_pos[:, :, None]  # [B, T, C]
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgtc,bckd->btkgd", p, v.astype(jnp.float32))
    return o.reshape(B, T, H, D).astype(q.dtype)


def forward_dense(w: Weights, cfg: ModelConfig, tokens, positions, cache: DenseKV, last_only=None):
    """tokens, positions: [B, T] int32 -> (logits [B, T, V] float32, updated cache).

    Writes each token's K/V at its position, then attends causally. With `last_only` ([B]
    int32 index into T), logits are computed only there: [B, 1, V] (prefill needs no more)."""
    B, T = tokens.shape
    h = nn.embed(w, tokens.reshape(-1))  # [B*T, E]
    flat_pos = positions.reshape(-1)  # [B*T]
    rows = jnp.repeat(jnp.arange(B), T)  # [B*T]
    sm_scale = cfg.head_dim**-0.5

    def layer_step(carry, xs):
        h, ck, cv = carry
        layer, i = xs
        q, k, v = nn.qkv(layer, h, flat_pos, cfg)  # [B*T, H|K, D]
        ck = ck.at[i, rows, flat_pos].set(k.astype(ck.dtype))
        cv = cv.at[i, rows, flat_pos].set(v.astype(cv.dtype))
        o = dense_attention(q.reshape(B, T, *q.shape[1:]), ck[i], cv[i], positions, sm_scale)
        h = nn.attn_out(layer, h, o.reshape(B * T, *o.shape[2:]))
        h = nn.mlp(layer, h, cfg)
        return (h, ck, cv), None

    (h, ck, cv), _ = jax.lax.scan(layer_step, (h, cache.k, cache.v), (w.layers, jnp.arange(cfg.num_layers)))
    if last_only is not None:
        h = h.reshape(B, T, -1)[jnp.arange(B), last_only]  # [B, E]
        return nn.logits(w, h, cfg)[:, None, :], DenseKV(ck, cv)
    return nn.logits(w, h, cfg).reshape(B, T, -1), DenseKV(ck, cv)


def forward_full(w: Weights, cfg: ModelConfig, tokens):
    """One forward over whole sequences with a fresh cache. tokens: [B, T] -> logits [B, T, V]."""
    B, T = tokens.shape
    cache = DenseKV.zeros(cfg, B, T, w.embed.dtype)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return forward_dense(w, cfg, tokens, positions, cache)[0]
