"""Size arithmetic every layer shares, plain Python with no imports (the simulator, the kv
host structures and the kernels all use it)."""


def pow2_at_least(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= n and >= minimum (itself a power of two)."""
    b = max(1, minimum)
    while b < n:
        b *= 2
    return b
