"""A request's sampling parameters and their validation, without a tensor library.

The router validates them on every Generate, so this module imports no JAX; the engines'
sampler (`sampling.py`) reads the same dataclass.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # <= 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1.0 disables; must be in (0, 1]
    seed: int = 0

    def validate(self) -> None:
        """Raises ValueError with one sentence on bad values."""
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.seed < 2**31):
            raise ValueError(f"seed must be in [0, 2^31), got {self.seed}")


GREEDY = SamplingParams()  # the default: greedy, no filtering
