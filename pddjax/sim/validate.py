"""Predicted against measured: the simulator's TTFT for `pddjax bench serve --quick`.

Inputs:
- the benchmark's JSON (`pddjax bench serve --json FILE`), at least
  {"modes": {"pdd": {"ttft_ms": {"p50", "p90", "p99"}}, "pd-cross": {...}, "pd-local": {...}}};
- this machine's engine profile (`pddjax bench engine --json FILE`, see `measured.py`);
- the emulated WAN settings the benchmark used (bandwidth, one-way latency, mean jitter);
- the trace the benchmark replayed (default: the "quick" workload preset).

The three benchmark modes map onto simulator modes with one instance per pool, all with the
measured timings: pdd -> "pdd" (P, RLD, MD), pd-cross -> "pd-cross" (P, MD), pd-local ->
"pd-local" (P, D over the direct link). Every request of the trace is measured (no window).
Known gap: the benchmark runs all instances on one machine, which the simulator does not
model as contention.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pddjax.sim.config import ClusterConfig, Pool, Sla
from pddjax.sim.measured import MeasuredInstance
from pddjax.sim.runner import simulate
from pddjax.workload.trace import TraceRequest

MODES = ("pdd", "pd-cross", "pd-local")
STATS = ("p50", "p99")
TOLERANCE = 0.25


@dataclass(frozen=True)
class WanSettings:
    gbps: float
    latency_ms: float
    jitter_ms: float = 0.0


def predict(perf: MeasuredInstance, wan: WanSettings, trace: list[TraceRequest]) -> dict:
    """Simulated {"modes": {mode: {"ttft_ms": {...}, ...}}} for the benchmark's three modes."""
    out = {}
    for mode in MODES:
        cfg = ClusterConfig(
            mode=mode, p=Pool(perf, 1), d=Pool(perf, 1), rld=Pool(perf, 1) if mode == "pdd" else None,
            wan_gbps=wan.gbps, wan_latency_s=wan.latency_ms / 1e3, wan_jitter_s=wan.jitter_ms / 1e3,
            tpot_target_s=10.0,  # the benchmark does not cap batches by step time
        )
        s = simulate(cfg, trace, Sla(), measure_all=True)
        out[mode] = {"ttft_ms": s["ttft_ms"], "rld_token_share": s["rld_token_share"],
                     "wan_bytes": s["wan_bytes"], "pipelines": s["pipelines"]}
    return {"modes": out}


def load_measured(path: str | Path) -> dict:
    """Read and check the benchmark JSON; ValueError with a sentence if it is unusable."""
    with open(path, encoding="utf-8") as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON ({e.msg})") from None
    modes = obj.get("modes") if isinstance(obj, dict) else None
    if not isinstance(modes, dict) or not any(m in modes for m in MODES):
        raise ValueError(f"{path} has no 'modes' object with any of {', '.join(MODES)}")
    for m, v in modes.items():
        if m in MODES and not all(isinstance(v.get("ttft_ms", {}).get(s), (int, float)) for s in STATS):
            raise ValueError(f"{path}: mode {m!r} lacks numeric ttft_ms p50 and p99")
    return obj


def compare(predicted: dict, measured: dict) -> list[dict]:
    """Rows {mode, stat, predicted_ms, measured_ms, error, ok} for modes present in both."""
    rows = []
    for mode in MODES:
        if mode not in measured["modes"]:
            continue
        for stat in STATS:
            p = predicted["modes"][mode]["ttft_ms"][stat]
            m = float(measured["modes"][mode]["ttft_ms"][stat])
            err = (p - m) / m if m else float("inf")
            rows.append({"mode": mode, "stat": stat, "predicted_ms": p, "measured_ms": m,
                         "error": err, "ok": abs(err) <= TOLERANCE})
    return rows


def format_table(rows: list[dict]) -> str:
    """Markdown table of `compare` rows."""
    lines = ["| mode | TTFT | predicted ms | measured ms | error | within 25% |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['stat']} | {r['predicted_ms']:.0f} | {r['measured_ms']:.0f} | "
                     f"{100 * r['error']:+.0f}% | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)
