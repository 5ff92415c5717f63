"""Model weights as a jit-friendly pytree with layers stacked on a leading axis.

Every weight declares its logical axes once (`LOGICAL_AXES`); shardings derive from them
(`partition_specs`). Layers are stacked so the forward pass `lax.scan`s over them and
compile time does not grow with depth. The architecture-specific weights (Qwen2's q/k/v biases,
Qwen3's per-head q/k norms) are None when the model has none: None is an empty pytree node, so
they cost nothing and the tree's structure tells jit which variant it traces.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from pddjax import env
from pddjax.model.config import ModelConfig


@flax.struct.dataclass
class LayerWeights:
    attn_norm: jax.Array  # [L, E]
    wq: jax.Array | None  # [L, E, H, D] (None once fused into wqkv)
    wk: jax.Array | None  # [L, E, K, D]
    wv: jax.Array | None  # [L, E, K, D]
    wo: jax.Array  # [L, H, D, E]
    mlp_norm: jax.Array  # [L, E]
    w_gate: jax.Array | None  # [L, E, F] (None once fused into w_gate_up)
    w_up: jax.Array | None  # [L, E, F]
    w_down: jax.Array  # [L, F, E]
    bq: jax.Array | None = None  # [L, H, D] q bias (ModelConfig.qkv_bias)
    bk: jax.Array | None = None  # [L, K, D]
    bv: jax.Array | None = None  # [L, K, D]
    q_norm: jax.Array | None = None  # [L, D] per-head RMSNorm scale of q (ModelConfig.qk_norm)
    k_norm: jax.Array | None = None  # [L, D]
    wqkv: jax.Array | None = None  # [L, E, (H + 2K) * D]: wq, wk, wv side by side (`fuse_projections`)
    w_gate_up: jax.Array | None = None  # [L, E, 2F]: w_gate, w_up side by side


OPTIONAL_LAYER_WEIGHTS = ("bq", "bk", "bv", "q_norm", "k_norm", "wqkv", "w_gate_up")
FUSED_FROM = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


@flax.struct.dataclass
class Weights:
    embed: jax.Array | None  # [V, E] (None in panels when tied: the head's panels hold it, `in_panels`)
    final_norm: jax.Array  # [E]
    lm_head: jax.Array | Panels | None  # [E, V], None when tied to `embed`; Panels (`in_panels`)
    layers: LayerWeights


# Logical axis names of every weight; mesh rules map them to device axes.
LOGICAL_AXES = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
    "attn_norm": ("layer", "embed"),
    "wq": ("layer", "embed", "q_heads", "head_dim"),
    "wk": ("layer", "embed", "kv_heads", "head_dim"),
    "wv": ("layer", "embed", "kv_heads", "head_dim"),
    "wo": ("layer", "q_heads", "head_dim", "embed"),
    "mlp_norm": ("layer", "embed"),
    "w_gate": ("layer", "embed", "ffn"),
    "w_up": ("layer", "embed", "ffn"),
    "w_down": ("layer", "ffn", "embed"),
    "bq": ("layer", "q_heads", "head_dim"),
    "bk": ("layer", "kv_heads", "head_dim"),
    "bv": ("layer", "kv_heads", "head_dim"),
    "q_norm": ("layer", "head_dim"),
    "k_norm": ("layer", "head_dim"),
    "wqkv": ("layer", "embed", None),  # fused only at degree 1: never split
    "w_gate_up": ("layer", "embed", None),
}

# Tensor-parallel rules: heads and ffn split over the "model" mesh axis.
DEFAULT_RULES = {"q_heads": "model", "kv_heads": "model", "ffn": "model", "vocab": "model"}


def to_dict(w: Weights) -> dict[str, np.ndarray]:
    """Flat name -> array dict (for checkpoints)."""
    out = {"embed": w.embed, "final_norm": w.final_norm}
    if w.lm_head is not None:
        out["lm_head"] = w.lm_head
    for name in LayerWeights.__dataclass_fields__:
        if getattr(w.layers, name) is not None:
            out[name] = getattr(w.layers, name)
    return out


def from_dict(d: dict) -> Weights:
    fused = {part for name, parts in FUSED_FROM.items() if name in d for part in parts}
    layers = LayerWeights(**{name: d.get(name) for name in LayerWeights.__dataclass_fields__
                             if name in d or name in fused or name not in OPTIONAL_LAYER_WEIGHTS})
    return Weights(embed=d["embed"], final_norm=d["final_norm"], lm_head=d.get("lm_head"), layers=layers)


def for_engine(w: Weights, one_device: bool) -> Weights:
    """What an engine computes with: the projections fused on one device (`PDDJAX_FUSE_PROJECTIONS`,
    default on), as given under a mesh."""
    return fuse_projections(w) if one_device and env.FUSE_PROJECTIONS.get() else w


def fuse_projections(w: Weights) -> Weights:
    """The same weights with q, k, v in one matrix and gate, up in another ([L, E, (H + 2K) * D],
    [L, E, 2F]), so a layer runs two input projections instead of five: on this CPU the real model's
    projections ran ~20% faster at 1-8 rows (one wider matrix product per input instead of three or
    two). For one device only: a split over heads or FFN would cut across the joined axis. Numpy
    in, numpy out when given numpy (engines fuse before they place the weights)."""
    lw = w.layers
    if lw.wqkv is not None:
        return w
    xp = np if isinstance(lw.wq, np.ndarray) else jnp
    L, E = lw.wq.shape[:2]
    wqkv = xp.concatenate([lw.wq.reshape(L, E, -1), lw.wk.reshape(L, E, -1), lw.wv.reshape(L, E, -1)], axis=-1)
    w_gate_up = xp.concatenate([lw.w_gate, lw.w_up], axis=-1)
    return w.replace(layers=lw.replace(wq=None, wk=None, wv=None, w_gate=None, w_up=None, wqkv=wqkv,
                                       w_gate_up=w_gate_up))


PANEL = 16  # columns of a panel (native/gemm.cc's NR)
IN_PANELS = ("wqkv", "wo", "w_gate_up", "w_down")  # the products a CPU step of few tokens reads in place


@flax.struct.dataclass
class Panels:
    """A stacked weight [L, K, N] laid out in panels of PANEL columns: data[l, p, k, j] is column
    p * PANEL + j of layer l (zeros past N). Each panel is a contiguous [K, PANEL] block, so the
    native product of a few rows (native/gemm.cc) reads the weight once, in order, in place; read
    column-panel by column-panel as stored, every row of a panel is a new page and the products
    of 4-32 rows ran ~2x slower. Sliced per layer (the layer scan), `data` is [P, K, PANEL]."""
    data: jax.Array  # [L, P, K, PANEL] (or [P, K, PANEL]: one layer)
    n: int = flax.struct.field(pytree_node=False)  # N: the columns of the weight

    @property
    def dtype(self):
        return self.data.dtype


ALIGN = 64  # bytes: XLA:CPU takes a host buffer aligned so without a copy (`cast`)


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-ordered array whose data starts on an ALIGN-byte boundary."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(size + ALIGN, np.uint8)
    at = (-raw.ctypes.data) % ALIGN
    return raw[at:at + size].view(dtype).reshape(shape)


def to_panels(w) -> Panels:
    """[L, K, N] -> Panels [L, ceil(N / PANEL), K, PANEL]. Numpy in, numpy out when given numpy, in
    an aligned buffer (an engine lays its weights out on the host before it places them, and
    `cast` hands that buffer to XLA as it is)."""
    L, K, N = w.shape
    P = -(-N // PANEL)
    if not isinstance(w, np.ndarray):
        padded = jnp.pad(w, ((0, 0), (0, 0), (0, P * PANEL - N))) if P * PANEL != N else w
        return Panels(jnp.transpose(padded.reshape(L, K, P, PANEL), (0, 2, 1, 3)), N)
    data = aligned_empty((L, P, K, PANEL), w.dtype)  # [L, P, K, PANEL]
    whole = N // PANEL
    data[:, :whole] = w[:, :, :whole * PANEL].reshape(L, K, whole, PANEL).transpose(0, 2, 1, 3)
    if whole < P:  # the last panel's columns past N are zeros
        data[:, whole:] = 0
        data[:, whole, :, :N - whole * PANEL] = w[:, :, whole * PANEL:]
    return Panels(data, N)


def wants_panels(w: Weights, attention: str, one_device: bool, dtype) -> bool:
    """Whether an engine holds these (fused) weights in panels: the native CPU kernels at one device,
    float32 (`layers.in_place_ok` then reads the four products and the LM head in place)."""
    return attention == "native" and one_device and w.layers.wqkv is not None and jnp.dtype(dtype) == jnp.float32


def in_panels(w: Weights) -> Weights:
    """The fused weights with the four products' weights (wo as [L, H * D, E]) and the LM head
    ([E, V], one layer) in panels: what a CPU engine at one device with the native kernels
    computes with (`wants_panels`, `layers.in_place_ok`). A tied embedding is held once, as the
    head's panels (`layers.embed` reads a token's row as a column of them); `embed` is None then.
    Numpy in, numpy out when given numpy."""
    lw = w.layers
    L, E = lw.wo.shape[0], lw.wo.shape[-1]
    head = to_panels((w.embed.T if w.lm_head is None else w.lm_head)[None])  # data [1, P, E, 16]
    return w.replace(embed=None if w.lm_head is None else w.embed, lm_head=head,
                     layers=lw.replace(wqkv=to_panels(lw.wqkv), wo=to_panels(lw.wo.reshape(L, -1, E)),
                                       w_gate_up=to_panels(lw.w_gate_up), w_down=to_panels(lw.w_down)))


def cast(w: Weights, dtype) -> Weights:
    """Matrices and biases to `dtype` (weights in panels too); norms (q/k norms too) stay float32
    (tiny and precision-sensitive)."""
    def to(name, v):
        want = jnp.float32 if name.endswith("norm") else dtype
        if isinstance(v, Panels):  # from `in_panels`: a buffer of its own, taken as it is when aligned
            data = v.data
            if isinstance(data, np.ndarray) and data.dtype == want:
                return Panels(jax.device_put(data, may_alias=True), v.n)
            return Panels(jnp.asarray(data, want), v.n)
        return jnp.asarray(v, want)

    return from_dict({k: None if v is None else to(k, v) for k, v in to_dict(w).items()})  # embed None: in panels


def partition_specs(w: Weights, rules: dict[str, str | None] = DEFAULT_RULES) -> Weights:
    """A Weights-shaped pytree of PartitionSpec derived from LOGICAL_AXES."""
    from jax.sharding import PartitionSpec

    specs = {k: PartitionSpec(*(rules.get(a) for a in LOGICAL_AXES[k])) for k in to_dict(w)}
    return from_dict(specs)


def init_random(cfg: ModelConfig, seed: int = 0) -> Weights:
    """Random weights (float32) for tests; scaled so activations stay O(1)."""
    L, E, H, K, D, F, V = (cfg.num_layers, cfg.hidden, cfg.num_heads, cfg.num_kv_heads,
                           cfg.head_dim, cfg.ffn_hidden, cfg.vocab_size)
    rng = np.random.default_rng(seed)

    def normal(*shape, fan_in):
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    layers = LayerWeights(
        attn_norm=(1.0 + 0.1 * rng.standard_normal((L, E))).astype(np.float32),
        wq=normal(L, E, H, D, fan_in=E),
        wk=normal(L, E, K, D, fan_in=E),
        wv=normal(L, E, K, D, fan_in=E),
        wo=normal(L, H, D, E, fan_in=H * D),
        mlp_norm=(1.0 + 0.1 * rng.standard_normal((L, E))).astype(np.float32),
        w_gate=normal(L, E, F, fan_in=E),
        w_up=normal(L, E, F, fan_in=E),
        w_down=normal(L, F, E, fan_in=F),
    )
    embed = rng.standard_normal((V, E)).astype(np.float32)
    lm_head = None if cfg.tie_embeddings else normal(E, V, fan_in=E)
    if cfg.qkv_bias:  # drawn after the rest, so a model without them keeps its weights
        layers = layers.replace(bq=normal(L, H, D, fan_in=4), bk=normal(L, K, D, fan_in=4),
                                bv=normal(L, K, D, fan_in=4))
    if cfg.qk_norm:
        layers = layers.replace(q_norm=(1.0 + 0.1 * rng.standard_normal((L, D))).astype(np.float32),
                                k_norm=(1.0 + 0.1 * rng.standard_normal((L, D))).astype(np.float32))
    return Weights(embed=embed, final_norm=np.ones((E,), np.float32), lm_head=lm_head, layers=layers)


def num_params(w: Weights) -> int:
    return sum(int(np.prod(v.shape)) for v in to_dict(w).values())
