"""A request's sampling parameters and their validation, without a tensor library.

The router validates them on every Generate, so this module imports no JAX; the engines'
sampler (`sampling.py`) reads the same dataclass.
"""

from __future__ import annotations

import dataclasses

MAX_TEMPERATURE = 100.0  # far past any useful value; keeps logits / temperature finite
MAX_TOP_K = 2**31 - 1  # the engine's top-k array is int32 (0 = off; any k >= vocab keeps every token)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # <= 0 means greedy; at most MAX_TEMPERATURE
    top_k: int = 0  # 0 disables; at most MAX_TOP_K
    top_p: float = 1.0  # 1.0 disables; must be in (0, 1]
    seed: int = 0  # [0, 2^31)

    def validate(self) -> None:
        """Raises ValueError with one sentence on bad values (NaN and infinities included)."""
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:  # False for NaN
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top-k must be in [0, 2^31), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must be in [0, 2^31), got {self.seed}")


GREEDY = SamplingParams()  # the default: greedy, no filtering
