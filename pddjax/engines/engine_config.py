"""An engine's static configuration (dtype, pages, attention, batch limits), without JAX.

Service configs are checked against these fields before any engine is built: the keys of a
role's `[engine]` table are exactly this dataclass's fields (`serving/config.py`).
"""

from __future__ import annotations

import dataclasses

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION = ("auto", "xla", "pallas")  # auto: XLA on CPU, Pallas on GPU/TPU


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    dtype: str = "float32"  # weights and KV: one of DTYPES
    page_size: int = 16
    num_pages: int = 256  # page 0 is scratch
    attention: str = "auto"  # "xla" | "pallas" | "auto" (XLA on CPU, Pallas on GPU/TPU)
    max_step_tokens: int = 256  # token budget of one step (prefill chunks fill what is left)
    max_rows: int = 32
    prefix_cache: bool = True
    # A step pads every row to its longest (attention runs over [B, Q] x [B, MP*S]). Prompt
    # rows (several tokens each) join a step only while B x Q stays within pad_limit x T (all
    # bucketed); a longer one waits for the next step. Rows of one token (decode) and the
    # extend chunks that join them are not limited (tail chunks ride with decodes). 0 = off.
    pad_limit: float = 1.5

    def check(self) -> str | None:
        """One sentence on what is wrong with these values, or None."""
        if self.dtype not in DTYPES:
            return f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"
        if self.attention not in ATTENTION:
            return f"attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}"
        for name in ("page_size", "num_pages", "max_step_tokens", "max_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                return f"{name} must be a positive integer, got {value!r}"
        if self.num_pages < 2:
            return f"num_pages must be at least 2 (page 0 is scratch), got {self.num_pages}"
        if not isinstance(self.prefix_cache, bool):
            return f"prefix_cache must be true or false, got {self.prefix_cache!r}"
        if not isinstance(self.pad_limit, int | float) or self.pad_limit < 0:
            return f"pad_limit must be a number >= 0, got {self.pad_limit!r}"
        return None
