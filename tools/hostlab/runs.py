"""Several `bench serve` runs of one trace as one measurement (validation against a noisy host).

On this 2-core VM two runs of the same trace, same code and pinning differ by up to 2x in a
mode's TTFT P50 (quick5 / quick7: pdd 2.1 / 4.4 s): which requests overlap on P decides it.
So validation compares the simulator with the *median* over runs and prints each run's value
beside it: an error larger than the runs' own spread is the model's, a smaller one is noise.
`combine` returns a measured-like dict: per mode `ttft_ms` p50 / p99 = the median over the
runs (`ttft_runs` keeps each run's), `cpu_s` and `history_s` medians, and per request the
median TTFT over the runs that served it (pipeline and hits from the first such run).
"""

from __future__ import annotations

import copy
import statistics

STATS = ("p50", "p99")  # the TTFT percentiles validation compares (validate.py)


def same_setup(runs: list[dict]) -> None:
    """ValueError with a sentence unless every run replayed the same trace on the same WAN and cores."""
    first = runs[0]
    for i, r in enumerate(runs[1:], 2):
        for key in ("wan", "cpus", "model"):
            if r.get(key) != first.get(key):
                raise ValueError(f"run {i} differs from run 1 in {key!r} ({r.get(key)} vs {first.get(key)}): "
                                 f"combine only runs of one setup")
        if (r.get("trace") or {}).get("config") != (first.get("trace") or {}).get("config"):
            raise ValueError(f"run {i} replayed another trace than run 1: combine only runs of one trace")


def combine(runs: list[dict]) -> dict:
    if not runs:
        raise ValueError("no benchmark runs to combine")
    if len(runs) == 1:
        return runs[0]
    same_setup(runs)
    out = copy.deepcopy(runs[0])
    for mode, fig in out["modes"].items():
        have = [r["modes"][mode] for r in runs if mode in r.get("modes", {})]
        fig["ttft_runs"] = {s: [float(h["ttft_ms"][s]) for h in have] for s in STATS}
        for s in STATS:
            fig["ttft_ms"][s] = statistics.median(fig["ttft_runs"][s])
        cpus = [h["cpu_s"] for h in have if isinstance(h.get("cpu_s"), dict)]
        if cpus:
            fig["cpu_s"] = {k: statistics.median(c[k] for c in cpus if k in c) for k in cpus[0]}
        hist = [h["history_s"] for h in have if isinstance(h.get("history_s"), (int, float))]
        if hist:
            fig["history_s"] = statistics.median(hist)
    for mode, rows in (out.get("requests") or {}).items():
        ttfts: dict[str, list[float]] = {}  # request id -> its TTFT in every run that served it
        for r in runs:
            for q in (r.get("requests") or {}).get(mode, []):
                if q.get("ttft_ms") is not None:
                    ttfts.setdefault(q["request_id"], []).append(q["ttft_ms"])
        for row in rows:
            if ttfts.get(row["request_id"]):
                row["ttft_ms"] = statistics.median(ttfts[row["request_id"]])
    out["runs"] = len(runs)
    return out
