"""Chained content hashes of full KV pages (host side, no jax).

Contract: `page_hash(prev, tokens) -> int` is blake2b (8-byte digest, read as an unsigned
little-endian int64) over `prev` as 8 little-endian bytes followed by the page's token ids
as little-endian int32. It is a pure function of its inputs, so it is identical across
processes, machines and Python hash seeds: P, RLD and MD can compare prefixes by hash
without sending tokens. A page's hash names the whole prefix up to and including it.

Only FULL pages are hashed; a trailing partial page has no hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_HASH: int = 0  # `prev` of the first page of every sequence
_MASK64 = (1 << 64) - 1


def page_hash(prev: int, page_tokens: Sequence[int]) -> int:
    """Hash of one full page chained onto the hash `prev` of the prefix before it.

    Returns an int in [0, 2**64).
    """
    toks = np.asarray(page_tokens, dtype=np.int64)  # [page_size]
    if toks.ndim != 1:
        raise ValueError(f"page_tokens must be 1-D, got shape {toks.shape}")
    if toks.size and (toks.min() < -(2**31) or toks.max() >= 2**31):
        raise ValueError("token ids must fit in int32")
    h = hashlib.blake2b(digest_size=8)
    h.update((prev & _MASK64).to_bytes(8, "little"))
    h.update(toks.astype("<i4").tobytes())
    return int.from_bytes(h.digest(), "little")


def chain_hashes(tokens: Sequence[int], page_size: int, prev: int = ROOT_HASH) -> list[int]:
    """Chained hashes of the full pages of `tokens`, starting from `prev`.

    Returns len(tokens) // page_size hashes; the trailing partial page is ignored.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    n_full = len(tokens) // page_size
    hashes: list[int] = []
    for i in range(n_full):
        prev = page_hash(prev, tokens[i * page_size : (i + 1) * page_size])
        hashes.append(prev)
    return hashes


def extend_hashes(hashes: Sequence[int], tokens: Sequence[int], page_size: int) -> list[int]:
    """Chained hashes of all full pages of `tokens`, reusing `hashes` already known for its
    leading pages (a decoding sequence hashes only the pages completed since last time).

    `hashes` must be a prefix of `chain_hashes(tokens, page_size)`; returns a new list.
    """
    n_known = len(hashes)
    if n_known * page_size > len(tokens):
        raise ValueError(f"{n_known} known page hashes but only {len(tokens)} tokens")
    prev = hashes[-1] if n_known else ROOT_HASH
    return list(hashes) + chain_hashes(tokens[n_known * page_size:], page_size, prev)
