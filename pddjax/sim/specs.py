"""Parsers for the planner's command-line values (formats in `pddjax plan --help`).

Each raises ValueError with one sentence on bad input.
"""

from __future__ import annotations

import dataclasses

from pddjax.sim.config import Sla
from pddjax.sim.hardware import ACCELERATORS, get_accelerator
from pddjax.sim.measured import MeasuredInstance
from pddjax.sim.model import MODELS, get_model
from pddjax.sim.roofline import RooflineInstance
from pddjax.workload.config import DEFAULT_HIT_MIX, PRESETS, WorkloadConfig, fixed_hit_mix


def _pairs(spec: str, what: str) -> dict[str, str]:
    out = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise ValueError(f"{what}: expected key=value, got {part!r}")
        k, v = part.split("=", 1)
        out[k.strip().lower()] = v.strip()
    return out


def _number(v: str, what: str) -> float:
    try:
        x = float(v[:-1]) * 1024 if v.lower().endswith("k") else float(v)
    except ValueError:
        raise ValueError(f"{what} must be a number, got {v!r}") from None
    if x <= 0:
        raise ValueError(f"{what} must be positive, got {v!r}")
    return x


def parse_traffic(spec: str) -> WorkloadConfig:
    """rps=R[,context=N][,output=N][,hit=H|skewed][,turns=T][,seed=S] -> WorkloadConfig."""
    kv = _pairs(spec, "--traffic")
    unknown = set(kv) - {"rps", "context", "output", "hit", "turns", "seed"}
    if unknown:
        raise ValueError(f"--traffic: unknown key(s) {', '.join(sorted(unknown))}")
    if "rps" not in kv:
        raise ValueError("--traffic needs rps=REQUESTS_PER_SECOND")
    wl = PRESETS["paper"]
    ctx = int(_number(kv.get("context", str(wl.context_tokens)), "context"))
    out = int(_number(kv.get("output", str(wl.output_fixed)), "output"))
    turns = _number(kv.get("turns", str(wl.turns_mean)), "turns")
    hit = kv.get("hit", "skewed")
    if hit == "skewed":
        mix = DEFAULT_HIT_MIX
    else:
        h = _number(hit, "hit") if hit not in ("0", "0.0") else 0.0
        if h > 1:
            raise ValueError(f"hit must be in [0, 1] or 'skewed', got {hit!r}")
        mix = fixed_hit_mix(h)
    if turns < 1:
        raise ValueError("turns must be at least 1")
    seed = int(_number(kv["seed"], "seed")) if "seed" in kv else 0
    wl = dataclasses.replace(wl, context_tokens=ctx, output_fixed=out, turns_mean=turns, hit_mix=mix, seed=seed)
    return wl.with_request_rate(_number(kv["rps"], "rps"))


def parse_sla(spec: str) -> Sla:
    """ttft=S,tpot=S[,attain=F] -> Sla."""
    kv = _pairs(spec, "--sla")
    unknown = set(kv) - {"ttft", "tpot", "attain"}
    if unknown or "ttft" not in kv or "tpot" not in kv:
        raise ValueError("--sla takes ttft=SECONDS,tpot=SECONDS[,attain=FRACTION]")
    attain = _number(kv.get("attain", "0.9"), "attain")
    if attain > 1:
        raise ValueError("attain must be a fraction in (0, 1]")
    return Sla(_number(kv["ttft"], "ttft"), _number(kv["tpot"], "tpot"), attain)


def parse_wans(spec: str) -> list[float]:
    """Comma-separated Gb/s values."""
    vals = [_number(v.strip(), "--wan-gbps value") for v in spec.split(",") if v.strip()]
    if not vals:
        raise ValueError("--wan-gbps needs at least one bandwidth")
    return sorted(vals)


def _instance(item: str, model_name: str):
    item = item.strip()
    if item.startswith("measured:"):
        try:
            return MeasuredInstance.load(item[len("measured:"):])
        except OSError as e:
            raise ValueError(f"cannot read engine profile {item[9:]!r}: {e.strerror}") from None
    name, _, price = item.partition("@")
    if name.lower() not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; choose from {', '.join(ACCELERATORS)}")
    acc = get_accelerator(name)
    if price:
        acc = acc.with_price(_number(price, "price"))
    if model_name.lower() not in MODELS:
        raise ValueError(f"unknown model {model_name!r}; choose from {', '.join(MODELS)}")
    return RooflineInstance.build(acc, get_model(model_name))


def parse_accelerators(spec: str, model_name: str):
    """PREFILL_SIDE[,DECODE_SIDE] -> (instance for P/RLD, instance for MD)."""
    items = [s for s in spec.split(",") if s.strip()]
    if not 1 <= len(items) <= 2:
        raise ValueError("--accelerators takes one or two entries: PREFILL_SIDE[,DECODE_SIDE]")
    a = _instance(items[0], model_name)
    b = _instance(items[1], model_name) if len(items) == 2 else a
    return a, b
