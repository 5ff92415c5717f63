"""A GGUF file's metadata without its weights: the model config and the raw fields.

This module imports no tensor library, so a process that needs only a model's facts (the
router: vocabulary size, context length, EOS ids, tokenizer) reads them without JAX.
"""

from __future__ import annotations

import os

from pddjax.model.config import ModelConfig, RopeScaling
from pddjax.model.fingerprint import file_sha256

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


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
    """The config of a llama / qwen2 (q/k/v biases) / qwen3 (per-head q/k norms) GGUF."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    p = arch + "."
    hidden = int(field(reader, p + "embedding_length"))
    heads = int(field(reader, p + "attention.head_count"))
    kv_heads = int(field(reader, p + "attention.head_count_kv", heads))
    rotary_default = field(reader, p + "rope.dimension_count", hidden // heads)
    head_dim = int(field(reader, p + "attention.key_length", rotary_default))
    rotary = int(field(reader, p + "rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise GGUFError(f"GGUF rope.dimension_count {rotary} differs from the head size {head_dim} "
                        "(partial rotary embeddings are not supported)")
    tokens = field(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFError("GGUF tensor rope_freqs.weight (Llama 3.1+ RoPE scaling factors) is not supported yet: "
                        "load the Hugging Face checkpoint directory instead")
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
        head_dim=head_dim,
        ffn_hidden=int(field(reader, p + "feed_forward_length")),
        rope_base=float(field(reader, p + "rope.freq_base", 10000.0)),
        rms_eps=float(field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names,
        max_context=int(field(reader, p + "context_length", 2048)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=_rope_scaling(reader, p),
    )


def _rope_scaling(reader, p: str) -> RopeScaling | None:
    kind = field(reader, p + "rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(field(reader, p + "rope.scaling.factor", 1.0)))
    raise GGUFError(f"GGUF rope.scaling.type {kind!r} is not supported (supported: none, linear)")


def file_fingerprint(path: str) -> str:
    """sha256 of the file's bytes (hex, first 16 chars): names the model on the wire and in caches.
    Computed once per (path, size, mtime) (`fingerprint.py`)."""
    return file_sha256(path)[:16]
