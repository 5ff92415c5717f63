"""A Hugging Face checkpoint's safetensors weights as a `Weights` pytree (layers stacked).

Every tensor the config implies is checked against the files' headers first (name, shape, dtype
F32 / BF16 / F16), so a missing tensor or a wrong shape is one sentence before any data is read;
tensors the loader would not use are refused too (a bias in a file whose config says none would
otherwise be dropped silently), except RoPE caches and a tied checkpoint's lm_head copy. Then
each tensor is read through `safetensors.safe_open` (memory-mapped), one at a time, transposed
into its slot of a preallocated stacked array: peak memory is one copy of the weights plus one
tensor. Host arrays keep the checkpoint's dtype (bf16 stays bf16; mixed dtypes become float32)
and norms are float32; engines cast to their own dtype.

HF layout -> ours: q_proj [H*D, E] -> wq [E, H, D]; o_proj [E, H*D] -> wo [H, D, E];
gate/up [F, E] -> [E, F]; down [E, F] -> [F, E]; lm_head [V, E] -> [E, V]; biases [H*D] -> [H, D].
Transposes are copied in 256 x 256 tiles (3x faster than numpy's whole-matrix strided copy).
"""

from __future__ import annotations

import os
import re

import ml_dtypes
import numpy as np

from pddjax.model.config import ModelConfig
from pddjax.model.hf_config import CheckpointError
from pddjax.model.hf_files import tensor_index, weight_files
from pddjax.model.weights import LayerWeights, Weights

DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16)}
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def layer_specs(cfg: ModelConfig) -> dict[str, tuple[str, tuple, tuple, bool]]:
    """our layer weight -> (HF name suffix, HF shape, our per-layer shape, transposed).

    transposed: ours is the HF matrix's transpose, reshaped (e.g. q_proj [H*D, E] -> wq [E, H, D]);
    otherwise ours is the HF tensor reshaped (norms, biases [H*D] -> [H, D])."""
    E, H, K, D, F = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_hidden
    specs = {
        "attn_norm": ("input_layernorm.weight", (E,), (E,), False),
        "wq": ("self_attn.q_proj.weight", (H * D, E), (E, H, D), True),
        "wk": ("self_attn.k_proj.weight", (K * D, E), (E, K, D), True),
        "wv": ("self_attn.v_proj.weight", (K * D, E), (E, K, D), True),
        "wo": ("self_attn.o_proj.weight", (E, H * D), (H, D, E), True),
        "mlp_norm": ("post_attention_layernorm.weight", (E,), (E,), False),
        "w_gate": ("mlp.gate_proj.weight", (F, E), (E, F), True),
        "w_up": ("mlp.up_proj.weight", (F, E), (E, F), True),
        "w_down": ("mlp.down_proj.weight", (E, F), (F, E), True),
    }
    if cfg.qkv_bias:
        specs["bq"] = ("self_attn.q_proj.bias", (H * D,), (H, D), False)
        specs["bk"] = ("self_attn.k_proj.bias", (K * D,), (K, D), False)
        specs["bv"] = ("self_attn.v_proj.bias", (K * D,), (K, D), False)
    if cfg.qk_norm:
        specs["q_norm"] = ("self_attn.q_norm.weight", (D,), (D,), False)
        specs["k_norm"] = ("self_attn.k_norm.weight", (D,), (D,), False)
    return specs


def top_specs(cfg: ModelConfig) -> dict[str, tuple[str, tuple, tuple, bool]]:
    E, V = cfg.hidden, cfg.vocab_size
    specs = {"embed": ("model.embed_tokens.weight", (V, E), (V, E), False),
             "final_norm": ("model.norm.weight", (E,), (E,), False)}
    if not cfg.tie_embeddings:
        specs["lm_head"] = ("lm_head.weight", (V, E), (E, V), True)
    return specs


def copy_into(target: np.ndarray, src: np.ndarray, transposed: bool, block: int = 256) -> None:
    """target (contiguous) <- src, or src.T when `transposed`, reshaped, cast to target's dtype.
    A transpose goes tile by tile: numpy's strided copy of a whole [F, E] matrix is ~3x slower."""
    if not transposed:
        target.reshape(src.shape)[...] = src
        return
    dst = target.reshape(src.shape[::-1])  # a view: [cols, rows] of src
    rows, cols = src.shape
    for i in range(0, rows, block):
        for j in range(0, cols, block):
            dst[j:j + block, i:i + block] = src[i:i + block, j:j + block].T


def _check(path: str, cfg: ModelConfig, index: dict) -> np.dtype:
    """Every tensor present with its shape and a float dtype, nothing unused; -> the host dtype of the
    matrices and biases (the checkpoint's when they share one, else float32)."""
    wanted = {hf: (shape, ours) for ours, (hf, shape, _, _) in top_specs(cfg).items()}
    for i in range(cfg.num_layers):
        wanted.update({f"model.layers.{i}.{hf}": (shape, ours) for ours, (hf, shape, _, _) in layer_specs(cfg).items()})
    for name, (shape, _) in wanted.items():
        if name not in index:
            raise CheckpointError(f"checkpoint {path} lacks tensor {name}")
        file, dtype, got = index[name]
        if got != shape:
            raise CheckpointError(f"tensor {name} in {os.path.basename(file)} has shape {list(got)}, "
                                  f"config.json implies {list(shape)}")
        if dtype not in DTYPES:
            raise CheckpointError(f"tensor {name} has dtype {dtype} (supported: {', '.join(DTYPES)})")
    for name in index:
        if name not in wanted and not IGNORED.fullmatch(name) and not (name == "lm_head.weight" and cfg.tie_embeddings):
            raise CheckpointError(f"checkpoint {path} holds tensor {name}, which its config.json does not call for")
    dtypes = {index[n][1] for n, (_, ours) in wanted.items() if not ours.endswith("norm")}  # norms: float32 anyway
    return DTYPES[dtypes.pop()] if len(dtypes) == 1 else DTYPES["F32"]


def load_weights(path: str, cfg: ModelConfig) -> Weights:
    """Read checkpoint directory `path` into Weights (numpy, see the module docstring)."""
    from safetensors import SafetensorError, safe_open

    files = weight_files(path)
    index = tensor_index(files)
    dtype = _check(path, cfg, index)
    host = lambda ours: np.float32 if ours.endswith("norm") else dtype  # noqa: E731
    lspecs, tspecs = layer_specs(cfg), top_specs(cfg)
    stacked = {k: np.empty((cfg.num_layers, *s[2]), host(k)) for k, s in lspecs.items()}  # [L, ...]
    top = {k: np.empty(s[2], host(k)) for k, s in tspecs.items()}
    wanted = {hf: (top, k, None, tr) for k, (hf, _, _, tr) in tspecs.items()}
    for i in range(cfg.num_layers):
        wanted.update({f"model.layers.{i}.{hf}": (stacked, k, i, tr) for k, (hf, _, _, tr) in lspecs.items()})
    for file in files:
        try:
            with safe_open(file, framework="numpy") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name not in wanted:
                        continue
                    out, key, layer, transposed = wanted[name]
                    target = out[key] if layer is None else out[key][layer]
                    copy_into(target, f.get_tensor(name), transposed)  # one tensor in memory at a time
        except SafetensorError as e:
            raise CheckpointError(f"cannot read {file} as safetensors: {e}") from None
    layers = LayerWeights(**stacked)
    return Weights(embed=top["embed"], final_norm=top["final_norm"], lm_head=top.get("lm_head"), layers=layers)
