"""A GGUF file's metadata without its weights: the model config and the raw fields.

This module imports no tensor library, so a process that needs only a model's facts (the
router: vocabulary size, context length, EOS ids, tokenizer) reads them without JAX.
"""

from __future__ import annotations

import hashlib
import os

from pddjax.model.config import ModelConfig

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


def file_fingerprint(path: str) -> str:
    """sha256 of the file's bytes (hex, first 16 chars): names the model on the wire and in caches."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]
