"""A GGUF file's metadata without its weights: the model config and the raw fields.

This module imports no tensor library, so a process that needs only a model's facts (the
router: vocabulary size, context length, EOS ids, tokenizer) reads them without JAX. The file is
untrusted: its header is walked against its size first (`gguf_check.py`), every dimension must be
a positive integer within `limits.py`'s bounds, and a malformed field is one sentence.
"""

from __future__ import annotations

import math
import os

from pddjax.model.config import ModelConfig, RopeScaling
from pddjax.model.fingerprint import file_sha256
from pddjax.model.gguf_check import header_problem
from pddjax.model.limits import limits_problem

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
# ModelConfig field -> GGUF metadata key (after "<arch>."), for the bounds' refusals
GGUF_NAMES = {"vocab_size": "vocab_size", "hidden": "embedding_length", "num_layers": "block_count",
              "num_heads": "attention.head_count", "num_kv_heads": "attention.head_count_kv",
              "head_dim": "attention.key_length", "ffn_hidden": "feed_forward_length",
              "max_context": "context_length"}


class GGUFError(ValueError):
    """The file is not a GGUF this loader can read (message is one sentence)."""


def open_reader(path: str):
    import gguf

    if not os.path.isfile(path):
        raise GGUFError(f"GGUF file not found: {path}")
    problem = header_problem(path)
    if problem:
        raise GGUFError(f"{path} is not a GGUF file this loader can read: {problem}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises assorted errors on bad files
        raise GGUFError(f"cannot read {path} as GGUF: {e}") from None


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except UnicodeDecodeError:
        raise GGUFError(f"GGUF metadata {key} is not valid UTF-8") from None


def _positive(reader, key: str, default: int | None = None) -> int:
    """An integer field that must be at least 1 (`default` when absent; required without one)."""
    value = field(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GGUFError(f"GGUF lacks metadata {key}" if value is None else
                        f"GGUF metadata {key} must be a positive integer, got {value!r}")
    return value


def _number(reader, key: str, default: float) -> float:
    value = field(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise GGUFError(f"GGUF metadata {key} must be a positive number, got {value!r}")
    return float(value)


def _token_id(reader, key: str) -> int | None:
    value = field(reader, key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise GGUFError(f"GGUF metadata {key} must be a token id, got {value!r}")
    return value


def config_from_gguf(reader, name: str) -> ModelConfig:
    """The config of a llama / qwen2 (q/k/v biases) / qwen3 (per-head q/k norms) GGUF."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    p = arch + "."
    hidden = _positive(reader, p + "embedding_length")
    heads = _positive(reader, p + "attention.head_count")
    kv_heads = _positive(reader, p + "attention.head_count_kv", heads)
    if heads % kv_heads:
        raise GGUFError(f"GGUF attention.head_count {heads} is not a multiple of attention.head_count_kv {kv_heads}")
    rotary_default = _positive(reader, p + "rope.dimension_count", max(hidden // heads, 1))
    head_dim = _positive(reader, p + "attention.key_length", rotary_default)
    rotary = _positive(reader, p + "rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise GGUFError(f"GGUF rope.dimension_count {rotary} differs from the head size {head_dim} "
                        "(partial rotary embeddings are not supported)")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise GGUFError("GGUF metadata tokenizer.ggml.tokens is missing or not a list of strings")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFError("GGUF tensor rope_freqs.weight (Llama 3.1+ RoPE scaling factors) is not supported yet: "
                        "load the Hugging Face checkpoint directory instead")
    eos = _token_id(reader, "tokenizer.ggml.eos_token_id")
    eot = _token_id(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(sorted({x for x in (eos, eot) if x is not None}))
    bos = _token_id(reader, "tokenizer.ggml.bos_token_id")
    cfg = ModelConfig(
        name=name,
        vocab_size=_positive(reader, p + "vocab_size", len(tokens)),
        hidden=hidden,
        num_layers=_positive(reader, p + "block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden=_positive(reader, p + "feed_forward_length"),
        rope_base=_number(reader, p + "rope.freq_base", 10000.0),
        rms_eps=_number(reader, p + "attention.layer_norm_rms_epsilon", 1e-5),
        tie_embeddings="output.weight" not in names,
        max_context=_positive(reader, p + "context_length", 2048),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=_rope_scaling(reader, p),
    )
    problem = limits_problem(cfg, {k: p + v for k, v in GGUF_NAMES.items()})
    if problem:
        raise GGUFError(f"GGUF metadata {problem}")
    return cfg


def _rope_scaling(reader, p: str) -> RopeScaling | None:
    kind = field(reader, p + "rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    if kind == "linear":
        return RopeScaling("linear", _number(reader, p + "rope.scaling.factor", 1.0))
    raise GGUFError(f"GGUF rope.scaling.type {kind!r} is not supported (supported: none, linear)")


def file_fingerprint(path: str) -> str:
    """sha256 of the file's bytes (hex, first 16 chars): names the model on the wire and in caches.
    Computed once per (path, size, mtime) (`fingerprint.py`)."""
    return file_sha256(path)[:16]
