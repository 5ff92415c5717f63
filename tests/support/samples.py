"""Data tests make up: random prompts (token ids of the tiny model's vocabulary), a random KV run
in the canonical form, and the reference engine's greedy answer to a prompt."""

from __future__ import annotations

import numpy as np

from pddjax.kv.canonical import KVRun
from pddjax.model.sampling_params import SamplingParams


def prompt(n: int, seed: int = 0, vocab: int = 512) -> list[int]:
    """`n` token ids drawn from [3, vocab) (0-2 are special), the same ones for the same seed."""
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def repetitive(n: int, seed: int) -> list[int]:
    """`n` token ids repeating one random 7-token unit: a context prompt lookup drafts from."""
    unit = prompt(7, seed)
    return (unit * (n // 7 + 1))[:n]

def greedy(ref, p: list[int], max_tokens: int) -> list[int]:
    """The greedy tokens the reference engine `ref` answers `p` with, ignoring EOS."""
    return ref.generate(p, SamplingParams(), max_tokens, ()).token_ids


def run_of(n: int = 40, dtype=np.float32, start: int = 0) -> KVRun:
    """A KV run of `n` tokens from `start` (2 layers, 2 KV heads, head_dim 16; V = -K)."""
    k = np.random.default_rng(0).standard_normal((2, n, 2, 16)).astype(dtype)  # [L, T, K, D]
    return KVRun("fp", start, k, -k, np.dtype(dtype).name)
