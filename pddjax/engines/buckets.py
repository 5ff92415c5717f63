"""Shape buckets: every jitted step sees one of a few shapes, so a steady workload never
recompiles. Plain Python (no jax)."""

from __future__ import annotations


def pow2_at_least(n: int, minimum: int = 1) -> int:
    b = max(1, minimum)
    while b < n:
        b *= 2
    return b


def token_bucket(n: int) -> int:
    """T: packed tokens per step. Starts at 1: on CPU a 1-token step runs as matrix-vector
    products, measured 2x faster than the same step padded to 8 tokens."""
    return pow2_at_least(n, 1)


def row_bucket(n: int) -> int:  # B: rows per step
    return pow2_at_least(n, 1)


def pages_bucket(n: int) -> int:
    """MP: page-table width. Multiples of 8 up to 64, then powers of two: attention reads
    MP * page_size slots per row, so a power-of-two bucket alone could nearly double it."""
    if n <= 64:
        return max(8, -(-n // 8) * 8)
    return pow2_at_least(n, 64)


def q_len_bucket(n: int) -> int:  # max tokens of any row in the step
    return pow2_at_least(n, 1)


def padded_past(limit: float, taken: list[int], n: int) -> bool:
    """Would a row of n > 1 tokens joining rows of `taken` tokens (all > 1: a step of prompt
    rows) pad the step's query block B x Q past `limit` x T? Rows of 1 token (decode) in
    `taken`: never (their step keeps its extend chunks). limit 0: never."""
    if limit <= 0 or min(taken) == 1:
        return False
    B, Q = row_bucket(len(taken) + 1), q_len_bucket(max(max(taken), n))
    return B * Q > limit * token_bucket(sum(taken) + n)
