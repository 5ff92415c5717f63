"""Load a llama / qwen2 / qwen3 GGUF's weights, dequantized, as a `Weights` pytree (its config
and metadata: `gguf_meta.py`).

Dequantization uses the `gguf` package (F32, F16, BF16, Q8_0, Q4_0, Q4_1 and the k-quants it
supports). For `llama`, GGUF's converter permutes Q/K rows so llama.cpp can apply RoPE to
adjacent pairs; we undo it so RoPE uses the HF "rotate_half" convention and our KV matches HF's
layout. qwen2 / qwen3 are converted unpermuted (llama.cpp runs them with NeoX-style RoPE, which
is rotate_half). qwen2 adds blk.N.attn_{q,k,v}.bias, qwen3 blk.N.attn_{q,k}_norm.weight.
Every tensor the config implies is checked (present, its shape) before any is dequantized.
"""

from __future__ import annotations

import numpy as np

from pddjax.model.config import ModelConfig
from pddjax.model.gguf_meta import GGUFError, field
from pddjax.model.weights import OPTIONAL_LAYER_WEIGHTS, LayerWeights, Weights


def dequantize(tensor) -> np.ndarray:
    """A GGUF tensor as float32 in numpy (row-major) order: [ne1, ne0] for a matrix."""
    import gguf

    shape = tuple(int(x) for x in reversed(tensor.shape))
    try:
        arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise GGUFError(f"tensor {tensor.name} has unsupported type {tensor.tensor_type.name}") from None
    return np.asarray(arr, np.float32).reshape(shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the converter's per-head RoPE row permutation. w: [n_heads*D, E] (rows = outputs)."""
    rows = w.shape[0]
    # the converter did reshape(n, 2, D/2, E).swapaxes(1, 2); this is its inverse
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> its shape in numpy order ([ne1, ne0]) under `cfg`."""
    E, H, K, D, F, V = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_hidden, cfg.vocab_size
    out = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
    if not cfg.tie_embeddings:
        out["output.weight"] = (V, E)
    per_layer = {"attn_norm.weight": (E,), "attn_q.weight": (H * D, E), "attn_k.weight": (K * D, E),
                 "attn_v.weight": (K * D, E), "attn_output.weight": (E, H * D), "ffn_norm.weight": (E,),
                 "ffn_gate.weight": (F, E), "ffn_up.weight": (F, E), "ffn_down.weight": (E, F)}
    if cfg.qkv_bias:
        per_layer.update({"attn_q.bias": (H * D,), "attn_k.bias": (K * D,), "attn_v.bias": (K * D,)})
    if cfg.qk_norm:
        per_layer.update({"attn_q_norm.weight": (D,), "attn_k_norm.weight": (D,)})
    for i in range(cfg.num_layers):
        out.update({f"blk.{i}.{k}": v for k, v in per_layer.items()})
    return out


def check_tensors(tensors: dict, cfg: ModelConfig) -> None:
    """Every tensor the config implies is present with its shape, or GGUFError."""
    for name, shape in expected_shapes(cfg).items():
        if name not in tensors:
            raise GGUFError(f"GGUF is missing tensor {name}")
        got = tuple(int(x) for x in reversed(tensors[name].shape))
        if got != shape:
            raise GGUFError(f"GGUF tensor {name} has shape {list(got)}, its metadata implies {list(shape)}")


def load_weights(reader, cfg: ModelConfig) -> Weights:
    """Dequantize every tensor into a float32 `Weights` (layers stacked)."""
    permuted = field(reader, "general.architecture") == "llama"
    unpermute = unpermute_qk if permuted else (lambda w, n: w)
    tensors = {t.name: t for t in reader.tensors}
    check_tensors(tensors, cfg)
    E, H, K, D, L = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers

    def get(name):
        if name not in tensors:
            raise GGUFError(f"GGUF is missing tensor {name}")
        return dequantize(tensors[name])

    optional = (("bq", "bk", "bv") if cfg.qkv_bias else ()) + (("q_norm", "k_norm") if cfg.qk_norm else ())
    per_layer = {k: [] for k in LayerWeights.__dataclass_fields__ if k not in OPTIONAL_LAYER_WEIGHTS or k in optional}
    for i in range(L):
        b = f"blk.{i}."
        per_layer["attn_norm"].append(get(b + "attn_norm.weight"))
        wq = unpermute(get(b + "attn_q.weight"), H)  # [H*D, E]
        wk = unpermute(get(b + "attn_k.weight"), K)  # [K*D, E]
        per_layer["wq"].append(wq.T.reshape(E, H, D))
        per_layer["wk"].append(wk.T.reshape(E, K, D))
        per_layer["wv"].append(get(b + "attn_v.weight").T.reshape(E, K, D))
        per_layer["wo"].append(get(b + "attn_output.weight").T.reshape(H, D, E))
        per_layer["mlp_norm"].append(get(b + "ffn_norm.weight"))
        per_layer["w_gate"].append(get(b + "ffn_gate.weight").T)  # [E, F]
        per_layer["w_up"].append(get(b + "ffn_up.weight").T)
        per_layer["w_down"].append(get(b + "ffn_down.weight").T)  # [F, E]
        if cfg.qkv_bias:
            per_layer["bq"].append(get(b + "attn_q.bias").reshape(H, D))
            per_layer["bk"].append(get(b + "attn_k.bias").reshape(K, D))
            per_layer["bv"].append(get(b + "attn_v.bias").reshape(K, D))
        if cfg.qk_norm:
            per_layer["q_norm"].append(get(b + "attn_q_norm.weight"))  # [D]
            per_layer["k_norm"].append(get(b + "attn_k_norm.weight"))
    layers = LayerWeights(**{k: np.ascontiguousarray(np.stack(v)) for k, v in per_layer.items()})
    embed = get("token_embd.weight")  # [V, E]
    lm_head = None if cfg.tie_embeddings else np.ascontiguousarray(get("output.weight").T)
    return Weights(embed=embed, final_norm=get("output_norm.weight"), lm_head=lm_head, layers=layers)
