"""A packed allowed-token mask applied to logits: constrained decoding's part of the jitted step.

mask: int32 [B, W], W = ceil(V / 32); bit j of word i allows token 32 * i + j (llguidance's
layout, `pddjax.grammar`). A disallowed token's logit becomes -inf; a row of all ones (-1 as
int32) changes nothing, which is what an unconstrained row passes. `apply` is the step's (jnp);
`allowed_np` / `apply_np` are its numpy twin, which the reference engine uses, so the two
unpackings check each other.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

ALL = -1  # an int32 word allowing its 32 tokens


def words(vocab_size: int) -> int:
    """int32 words of one mask row."""
    return (vocab_size + 31) // 32


def apply(logits, mask):
    """logits: [B, V] float32; mask: [B, W] int32 -> [B, V] with disallowed tokens at -inf."""
    B, V = logits.shape
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    allowed = bits.reshape(B, -1)[:, :V] != 0  # [B, V]
    return jnp.where(allowed, logits, -jnp.inf)


def allowed_np(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """mask: int32 [..., W] -> bool [..., V]: which tokens it allows."""
    m = np.ascontiguousarray(mask, "<i4")  # little-endian words: byte k of word i holds tokens 32 i + 8 k ..
    bits = np.unpackbits(m.view(np.uint8), axis=-1, bitorder="little")  # [..., 32 W]
    return bits[..., :vocab_size].astype(bool)


def apply_np(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """numpy `apply`: logits [B, V] -> a copy with disallowed tokens at -inf."""
    return np.where(allowed_np(mask, logits.shape[-1]), logits, -np.inf).astype(logits.dtype)


def all_allowed(B: int, vocab_size: int) -> np.ndarray:
    """An int32 [B, W] mask of all ones (every token allowed)."""
    return np.full((B, words(vocab_size)), ALL, np.int32)
