"""The pieces of a Llama block that do not depend on how KV is stored.

Letters: T tokens, E model width, H query heads, K kv heads, G = H/K, D head dim, F ffn width,
V vocab. Norms and softmax accumulate in float32; matmuls run in the weights' dtype.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pddjax.model.config import ModelConfig, RopeScaling
from pddjax.model.weights import IN_PANELS, PANEL, Panels, Weights


def rms_norm(x, scale, eps: float):
    # x: [..., E], scale: [E]
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(d: int, base: float, scaling: RopeScaling | None = None):
    """[D/2] float32 inverse frequencies, with HF's `rope_scaling` applied (llama3, linear)."""
    inv_freq = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, the band between interpolated
    factor, old_ctx = scaling.factor, scaling.original_max_context
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope(x, positions, base: float, scaling: RopeScaling | None = None):
    """Rotary embedding, HF "rotate_half" convention (GGUF's Q/K permutation is undone at load).

    x: [T, N, D], positions: [T] int32 -> [T, N, D]
    """
    d = x.shape[-1]
    inv_freq = rope_inv_freq(d, base, scaling)  # [D/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, None, :]  # [T, 1, D]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : d // 2], x32[..., d // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


IN_PLACE_MAX_TOKENS = 64  # steps of up to this many tokens: decode batches, extend, a verify; not prefill


@dataclasses.dataclass(frozen=True)
class InPlace:
    """A stacked weight in panels at layer `i`, read where it lies by the native product
    (pddjax/model/attention/native/gemm.cc): inside the layer scan XLA would copy the layer's
    slice out first, then its matrix library would pack it again."""
    stacked: Panels  # data [L, P, K, 16] float32
    i: jax.Array  # [] int32


def mm(x, w):
    """x [T, K] @ w [K, N] -> [T, N]; an InPlace weight through the native product, one layer's
    Panels (data [P, K, 16]) through XLA."""
    if isinstance(w, InPlace):
        from pddjax.model.attention import native_paged

        return native_paged.product_in_place(x, w.stacked.data, w.i, w.stacked.n)
    if isinstance(w, Panels):
        return jnp.einsum("tk,pkj->tpj", x, w.data).reshape(x.shape[0], -1)[:, :w.n]
    return x @ w


def in_place_ok(lw) -> bool:
    """The layers' weights can be read in place: the four products' weights in panels
    (`weights.in_panels`: fused, one device), float32."""
    return all(isinstance(getattr(lw, n), Panels) and getattr(lw, n).dtype == jnp.float32 for n in IN_PANELS)


def layer_in_place(lw, i):
    """Layer i's weights: the small ones sliced, the four products' weights as InPlace."""
    small = jax.tree_util.tree_map(lambda a: a[i], lw.replace(**{n: None for n in IN_PANELS}))
    return small.replace(**{n: InPlace(getattr(lw, n), i) for n in IN_PANELS})


def qkv(layer, h, positions, cfg: ModelConfig):
    """Pre-norm attention inputs. h: [T, E] -> q [T, H, D], k [T, K, D], v [T, K, D].

    Qwen2 adds q/k/v biases (`cfg.qkv_bias`); Qwen3 RMS-normalizes each head of q and k over D
    (`cfg.qk_norm`) before RoPE."""
    x = rms_norm(h, layer.attn_norm, cfg.rms_eps)
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if layer.wqkv is not None:  # fused (weights.fuse_projections): one product, then split
        y = mm(x, layer.wqkv)  # [T, (H + 2K) * D]
        T = y.shape[0]
        q = y[:, :H * D].reshape(T, H, D)
        k = y[:, H * D:(H + K) * D].reshape(T, K, D)
        v = y[:, (H + K) * D:].reshape(T, K, D)
    else:
        q = jnp.einsum("te,ehd->thd", x, layer.wq)
        k = jnp.einsum("te,ekd->tkd", x, layer.wk)
        v = jnp.einsum("te,ekd->tkd", x, layer.wv)
    if cfg.qkv_bias:
        q, k, v = q + layer.bq, k + layer.bk, v + layer.bv  # biases: [H, D], [K, D], [K, D]
    if cfg.qk_norm:
        q, k = rms_norm(q, layer.q_norm, cfg.rms_eps), rms_norm(k, layer.k_norm, cfg.rms_eps)
    base, scaling = cfg.rope_base, cfg.rope_scaling
    return rope(q, positions, base, scaling), rope(k, positions, base, scaling), v


def attn_out(layer, h, attn):
    """Residual add of the attention output. h: [T, E], attn: [T, H, D] -> [T, E]."""
    if isinstance(layer.wo, (InPlace, Panels)):  # wo as [H * D, E]
        return h + mm(attn.astype(h.dtype).reshape(attn.shape[0], -1), layer.wo)
    return h + jnp.einsum("thd,hde->te", attn.astype(h.dtype), layer.wo)


def mlp(layer, h, cfg: ModelConfig):
    """Residual SwiGLU block. h: [T, E] -> [T, E]."""
    x = rms_norm(h, layer.mlp_norm, cfg.rms_eps)
    if layer.w_gate_up is not None:  # fused: one product, then split
        gate_up = mm(x, layer.w_gate_up)  # [T, 2F]
        gate, up = gate_up[:, :cfg.ffn_hidden], gate_up[:, cfg.ffn_hidden:]
    else:
        gate = jnp.einsum("te,ef->tf", x, layer.w_gate)
        up = jnp.einsum("te,ef->tf", x, layer.w_up)
    if isinstance(layer.w_down, (InPlace, Panels)):
        return h + mm(jax.nn.silu(gate) * up, layer.w_down)
    # einsum, not `@`: XLA:CPU ran the 1-row step's sliced [F, E] product ~2x slower as a matmul
    return h + jnp.einsum("tf,fe->te", jax.nn.silu(gate) * up, layer.w_down)


def embed(w: Weights, tokens):
    # tokens: [T] int32 -> [T, E]
    if w.embed is None:  # tied, in panels (weights.in_panels): token t is column t of the head [E, V]
        return w.lm_head.data[0][tokens // PANEL, :, tokens % PANEL]
    return jnp.take(w.embed, tokens, axis=0)


def logits(w: Weights, h, cfg: ModelConfig):
    """Final norm and LM head. h: [T, E] -> [T, V] float32."""
    x = rms_norm(h, w.final_norm, cfg.rms_eps)
    if isinstance(w.lm_head, Panels):  # a native CPU engine's (weights.in_panels): read in place
        head = w.lm_head
        if x.shape[0] <= IN_PLACE_MAX_TOKENS:
            return mm(x, InPlace(head, jnp.int32(0)))
        return mm(x, jax.tree_util.tree_map(lambda a: a[0], head))
    head = w.embed.T if w.lm_head is None else w.lm_head  # [E, V]
    return jnp.einsum("te,ev->tv", x, head, preferred_element_type=jnp.float32)


def layer_at(w: Weights, i):
    """Weights of layer i (dynamic index), for use inside a scan or fori_loop."""
    return jax.tree_util.tree_map(lambda a: a[i], w.layers)
