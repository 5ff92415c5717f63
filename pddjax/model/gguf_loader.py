"""Load a Llama-family GGUF: config from metadata, dequantized weights as a `Weights` pytree.

Dequantization uses the `gguf` package (F32, F16, BF16, Q8_0, Q4_0, Q4_1 and the k-quants it
supports). GGUF's converter permutes Q/K rows so llama.cpp can apply RoPE to adjacent pairs;
we undo it so RoPE uses the HF "rotate_half" convention and our KV matches HF's layout.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from pddjax.model.config import ModelConfig
from pddjax.model.weights import LayerWeights, Weights

SUPPORTED_ARCHS = ("llama",)


class GGUFError(ValueError):
    """The file is not a GGUF this loader can read (message is one sentence)."""


def open_reader(path: str):
    import gguf

    if not os.path.isfile(path):
        raise GGUFError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises assorted errors on bad files
        raise GGUFError(f"cannot read {path} as GGUF: {e}") from None


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def config_from_gguf(reader, name: str) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    p = arch + "."
    hidden = int(field(reader, p + "embedding_length"))
    heads = int(field(reader, p + "attention.head_count"))
    kv_heads = int(field(reader, p + "attention.head_count_kv", heads))
    tokens = field(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    eot = field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(sorted({int(x) for x in (eos, eot) if x is not None}))
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        name=name,
        vocab_size=int(field(reader, p + "vocab_size", len(tokens))),
        hidden=hidden,
        num_layers=int(field(reader, p + "block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(field(reader, p + "rope.dimension_count", hidden // heads)),
        ffn_hidden=int(field(reader, p + "feed_forward_length")),
        rope_base=float(field(reader, p + "rope.freq_base", 10000.0)),
        rms_eps=float(field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names,
        max_context=int(field(reader, p + "context_length", 2048)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
    )


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


def load_weights(reader, cfg: ModelConfig) -> Weights:
    """Dequantize every tensor into a float32 `Weights` (layers stacked)."""
    tensors = {t.name: t for t in reader.tensors}
    E, H, K, D, L = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers

    def get(name):
        if name not in tensors:
            raise GGUFError(f"GGUF is missing tensor {name}")
        return dequantize(tensors[name])

    per_layer = {k: [] for k in LayerWeights.__dataclass_fields__}
    for i in range(L):
        b = f"blk.{i}."
        per_layer["attn_norm"].append(get(b + "attn_norm.weight"))
        wq = unpermute_qk(get(b + "attn_q.weight"), H)  # [H*D, E]
        wk = unpermute_qk(get(b + "attn_k.weight"), K)  # [K*D, E]
        per_layer["wq"].append(wq.T.reshape(E, H, D))
        per_layer["wk"].append(wk.T.reshape(E, K, D))
        per_layer["wv"].append(get(b + "attn_v.weight").T.reshape(E, K, D))
        per_layer["wo"].append(get(b + "attn_output.weight").T.reshape(H, D, E))
        per_layer["mlp_norm"].append(get(b + "ffn_norm.weight"))
        per_layer["w_gate"].append(get(b + "ffn_gate.weight").T)  # [E, F]
        per_layer["w_up"].append(get(b + "ffn_up.weight").T)
        per_layer["w_down"].append(get(b + "ffn_down.weight").T)  # [F, E]
    layers = LayerWeights(**{k: np.ascontiguousarray(np.stack(v)) for k, v in per_layer.items()})
    embed = get("token_embd.weight")  # [V, E]
    lm_head = None if cfg.tie_embeddings else np.ascontiguousarray(get("output.weight").T)
    return Weights(embed=embed, final_norm=get("output_norm.weight"), lm_head=lm_head, layers=layers)


def file_fingerprint(path: str) -> str:
    """sha256 of the file's bytes (hex, first 16 chars): names the model on the wire and in caches."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]
