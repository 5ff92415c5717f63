"""An instance profile measured by `pddjax bench engine --json` on a real machine.

Input (extra keys ignored):

    {"model": "smollm2-135m",
     "decode_ms": {"1": 9.1, "8": 10.4, "32": 15.0},     # one decode step at batch B
     "extend_ms": {"1": 9.0, "16": 11.2, "64": 19.8},    # one extend pass over T tokens
     "prefill_tokens_per_s": 5200.0,
     "kv_capacity_tokens": 200000,                        # optional
     "kv_bytes_per_token": 23040,                         # optional (default: SmolLM2-135M)
     "context": 256, "page_size": 16,                     # optional: where the steps were timed
     "attention_ns_per_pair": 1700,                       # optional host calibration (engine_steps.py)
     "gather_ns_per_slot": 14000, "gather_far_ns_per_slot": 38000, "gather_knee_slots": 1024,
     "step_table": [[T, B, width, Q, ms], ...],          # optional: measured step shapes (step_table.py)
     "first_use_ms": ms}                                 # optional: a shape's first step costs this more

Times are interpolated piecewise-linearly in batch / tokens, extrapolated linearly past the
last point and clamped below the first. `step_s` / `prefill_s` (the cluster-scale model)
ignore context length; a decode step with extend chunks batched in costs decode(B) +
extend(T) - extend(1): the chunk's tokens ride on a pass that already reads the weights.
The step-accurate model of one host (`engine_steps.py`) adds the context terms.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


def interp(table: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear interpolation over sorted (x, y) points, linear past the end."""
    if x <= table[0][0] or len(table) == 1:
        return table[0][1]
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = table[-2], table[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def _table(obj: dict, key: str) -> list[tuple[float, float]]:
    raw = obj.get(key)
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"engine profile needs a non-empty object {key!r}")
    try:
        pts = sorted((float(k), float(v) / 1000.0) for k, v in raw.items())
    except (TypeError, ValueError):
        raise ValueError(f"engine profile {key!r} must map numbers to milliseconds") from None
    if any(x <= 0 or y <= 0 for x, y in pts):
        raise ValueError(f"engine profile {key!r} has non-positive entries")
    return pts


def _steps(obj: dict) -> tuple:
    rows = obj.get("step_table") or []
    try:
        out = tuple(((int(t), int(b), int(w), int(q)), float(ms) / 1e3) for t, b, w, q, ms in rows)
    except (TypeError, ValueError):
        raise ValueError("'step_table' must be a list of [T, B, width, Q, ms] rows") from None
    if any(s <= 0 for _, s in out):
        raise ValueError("'step_table' times must be positive")
    return out


def _nonneg(obj: dict, key: str) -> float:
    x = obj.get(key, 0.0)
    if not isinstance(x, (int, float)) or x < 0:
        raise ValueError(f"engine profile {key!r} must be a number >= 0")
    return float(x)


@dataclass(frozen=True)
class MeasuredInstance:
    """Same interface as `RooflineInstance`, from measured step times."""

    model_name: str
    decode: list[tuple[float, float]]  # (batch, seconds)
    extend: list[tuple[float, float]]  # (tokens, seconds)
    prefill_tokens_per_s: float
    kv_capacity_tokens: int = 1_000_000
    kv_bytes_per_token: float = 23_040.0  # SmolLM2-135M unless the profile says otherwise
    chips: int = 1
    cost_per_hour: float = 1.0
    context: int = 256  # context length of the timed decode / extend steps
    page_size: int = 16
    attention_ns_per_pair: float = 0.0  # per padded (query slot, KV slot) pair of a step
    gather_ns_per_slot: float = 0.0  # per padded (row, KV slot) of a step, up to the knee
    gather_far_ns_per_slot: float = 0.0  # beyond the knee (0: same as below it)
    gather_knee_slots: int = 1024  # (rows x KV slots) gathered per step before copies leave the caches
    step_table: tuple = ()  # ((T, B, page-table width, Q), seconds): measured engine steps per shape
    first_use_s: float = 0.0  # extra seconds of a step shape's first use in an engine (lower + load the executable)

    @classmethod
    def from_json(cls, obj: dict, cost_per_hour: float = 1.0) -> MeasuredInstance:
        rate = obj.get("prefill_tokens_per_s")
        if not isinstance(rate, (int, float)) or rate <= 0:
            raise ValueError("engine profile needs a positive 'prefill_tokens_per_s'")
        return cls(
            model_name=str(obj.get("model", "measured")), decode=_table(obj, "decode_ms"),
            extend=_table(obj, "extend_ms"), prefill_tokens_per_s=float(rate),
            kv_capacity_tokens=int(obj.get("kv_capacity_tokens", 1_000_000)), cost_per_hour=cost_per_hour,
            kv_bytes_per_token=float(obj.get("kv_bytes_per_token", 23_040.0)),
            context=int(obj.get("context", 256)), page_size=int(obj.get("page_size", 16)),
            attention_ns_per_pair=_nonneg(obj, "attention_ns_per_pair"),
            gather_ns_per_slot=_nonneg(obj, "gather_ns_per_slot"),
            gather_far_ns_per_slot=_nonneg(obj, "gather_far_ns_per_slot"),
            gather_knee_slots=int(obj.get("gather_knee_slots", 1024)),
            step_table=_steps(obj), first_use_s=_nonneg(obj, "first_use_ms") / 1e3,
        )

    @classmethod
    def load(cls, path: str | Path, cost_per_hour: float = 1.0) -> MeasuredInstance:
        with open(path, encoding="utf-8") as f:
            return cls.from_json(json.load(f), cost_per_hour)

    @property
    def name(self) -> str:
        return f"measured:{self.model_name}"

    def prefill_s(self, new: int, cached: int) -> float:
        return max(new, 1) / self.prefill_tokens_per_s

    def step_s(self, batch: int, ctx_sum: float, ext_tokens: int = 0, ext_ctx: float = 0,
               ext_pairs: float = 0) -> float:
        if batch <= 0:
            return interp(self.extend, max(ext_tokens, 1))
        t = interp(self.decode, batch)
        if ext_tokens > 0:
            t += max(0.0, interp(self.extend, ext_tokens) - interp(self.extend, 1))
        return t
