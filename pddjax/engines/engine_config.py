"""An engine's static configuration (dtype, pages, attention, batch limits), without JAX.

Service configs are checked against these fields before any engine is built: the keys of a
role's `[engine]` table are exactly this dataclass's fields (`serving/config.py`).
"""

from __future__ import annotations

import dataclasses

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION = ("auto", "xla", "pallas", "native")  # auto: native (else XLA) on CPU, Pallas on GPU/TPU
SPECULATIVE = ("off", "ngram")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    dtype: str = "float32"  # weights and KV: one of DTYPES
    page_size: int = 16
    num_pages: int = 256  # page 0 is scratch
    attention: str = "auto"  # "xla" | "pallas" | "native" (CPU) | "auto" (native, else XLA, on CPU; Pallas on GPU/TPU)
    max_step_tokens: int = 256  # token budget of one step (prefill chunks fill what is left)
    max_rows: int = 32
    prefix_cache: bool = True
    # A step pads every row to its longest (attention runs over [B, Q] x [B, MP*S]). A row joins
    # a step of several rows with a multi-token row in it only while B x Q of the member the
    # step would take stays within pad_limit x the step's own tokens, pad_limit x
    # buckets.MIXED_PAD (4) when decode rows are in it (`buckets.pads_past`); else it waits for
    # the next step, where multi-token rows go first (`buckets.step_order`). Steps of one-token
    # rows only are never limited. 0 = off (and the coarse Q = T mixed members, `bucket_set`).
    pad_limit: float = 1.5
    # Devices of one engine (tensor parallelism over a "model" mesh axis: pddjax/engines/mesh.py);
    # a model admits N when `degree_problem` says nothing. On CPU N fake devices are made (tests).
    tensor_parallel: int = 1
    # What a service builds before it reports SERVING (pddjax/engines/precompile.py): "cover",
    # a covering few step shapes, the rest compiled in the background while it serves; "all",
    # the whole stated set first (minutes on a cold cache for the real model).
    ready: str = "cover"
    # Speculative decoding (pddjax/engines/speculate.py): "ngram" drafts by prompt lookup and
    # verifies the drafts in decode steps, at most spec_max_tokens per row per step; "off".
    speculative: str = "off"
    spec_max_tokens: int = 4

    def check(self) -> str | None:
        """One sentence on what is wrong with these values, or None."""
        if self.dtype not in DTYPES:
            return f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"
        if self.attention not in ATTENTION:
            return f"attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}"
        if self.speculative not in SPECULATIVE:
            return f"speculative must be one of {', '.join(SPECULATIVE)}, got {self.speculative!r}"
        for name in ("page_size", "num_pages", "max_step_tokens", "max_rows", "tensor_parallel", "spec_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                return f"{name} must be a positive integer, got {value!r}"
        if self.num_pages < 2:
            return f"num_pages must be at least 2 (page 0 is scratch), got {self.num_pages}"
        if not isinstance(self.prefix_cache, bool):
            return f"prefix_cache must be true or false, got {self.prefix_cache!r}"
        if self.ready not in ("all", "cover"):
            return f"ready must be \"all\" or \"cover\", got {self.ready!r}"
        if not isinstance(self.pad_limit, int | float) or self.pad_limit < 0:
            return f"pad_limit must be a number >= 0, got {self.pad_limit!r}"
        return None


def degree_problem(degree: int, num_heads: int, num_kv_heads: int) -> str | None:
    """One sentence if a model with these heads does not admit tensor-parallel `degree`, or None.

    The rule: query heads divisible by N, and either KV heads divisible by N (the KV pool and
    the k/v projections split over KV heads) or N a multiple of the KV heads (KV replicated on
    every device: each device's query heads then share one KV head). SmolLM2-135M (9 query, 3 KV
    heads) admits 1, 3 (split) and 9 (replicated); tiny (4 / 2) admits 1, 2 and 4."""
    if num_heads % degree:
        return (f"tensor_parallel = {degree} does not divide the model's {num_heads} query heads "
                f"(admitted: {', '.join(map(str, admitted_degrees(num_heads, num_kv_heads)))})")
    if num_kv_heads % degree and degree % num_kv_heads:
        return (f"tensor_parallel = {degree} neither divides nor is a multiple of the model's {num_kv_heads} KV heads "
                f"(admitted: {', '.join(map(str, admitted_degrees(num_heads, num_kv_heads)))})")
    return None


def admitted_degrees(num_heads: int, num_kv_heads: int) -> list[int]:
    """Every tensor-parallel degree `degree_problem` accepts for these heads."""
    return [n for n in range(1, num_heads + 1)
            if num_heads % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0)]
