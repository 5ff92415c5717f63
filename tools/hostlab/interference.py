"""Cross-core slowdowns as a benchmark run itself saw them, from its services' step logs.

    python -m tools.hostlab.interference --measured bench.json --logs DIR --calibration host.json \
        [--modes pdd,pd-local] [--json out.json]

`crosscore.py` times the slowdowns on an idle machine, but on this VM they change from one
measurement to the next (decode|large 1.57 then 1.10; decode|decode 1.12, 1.27, 2.0 — the
two vCPUs seem to share a physical core some of the time), so a calibration taken an hour
before the benchmark may not describe it. The step logs (`PDDJAX_STEP_LOG`) hold every
engine step of the run with its interval and shape, so the same ratio can be read from the
run: for a step of class x (`pddjax.sim.host.step_class`) on one core set, r = its wall time
over the measured step table's time for its shape; b_x = median r of x's steps that nothing on
another core set overlapped; w_xy = median r of x's steps that class-y steps of another core
set covered >= `min_cover` of (the majority class); slow[x|y] = w_xy / b_x. Only steps that
no other service of their own core set overlapped count (processor sharing would inflate
them), and a pair needs `min_steps` steps on both sides, else it is left out (the
calibration's value, if any, stays). The output is a calibration's `cross_slowdown`; take it
from one run and validate on others, so that no run is predicted from its own timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

from pddjax.sim.host import step_class
from tools.hostlab.steplog import add_run_args, read_log, read_run, service_logs


def _steps(path: str, window: tuple[float, float]) -> list[tuple[float, float, tuple, str]]:
    """(start, end, shape key, class) of the logged steps inside the window."""
    out = []
    for e in read_log(path):
        if e["k"] == "step" and window[0] <= e["t"] <= window[1] and len(e["shape"]) >= 5:
            T, B, MP, Q, rows = e["shape"][:5]
            out.append((e["t"] - e["wall"], e["t"], (T, B, MP, Q), step_class(T, rows, Q == 1)))
    return out


def _cover(a: float, b: float, others: list[tuple[float, float, tuple, str]]) -> dict[str, float]:
    """Seconds of [a, b) that the other steps (non-overlapping among themselves) cover, per class."""
    got: dict[str, float] = defaultdict(float)
    for s, e, _, cls in others:
        if e > a and s < b:
            got[cls] += min(b, e) - max(a, s)
    return got


def ratios(runs: list[dict[str, list]], sets: dict[str, tuple], table: dict, min_cover: float = 0.8):
    """{x: {"alone": [r, ...], y: [r, ...]}} over the runs ({role: steps} each)."""
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for steps in runs:
        for role, mine in steps.items():
            same = [s for r, ss in steps.items() if r != role and sets.get(r) == sets.get(role) for s in ss]
            other = [s for r, ss in steps.items() if sets.get(r) != sets.get(role) for s in ss]
            for a, b, key, cls in mine:
                if key not in table or b <= a or sum(_cover(a, b, same).values()) > 0:
                    continue
                r = (b - a) / table[key]
                cover = _cover(a, b, other)
                total = sum(cover.values())
                if total == 0:
                    out[cls]["alone"].append(r)
                elif total >= min_cover * (b - a):
                    out[cls][max(cover, key=cover.get)].append(r)
    return out


def slowdowns(rat: dict, min_steps: int = 5) -> dict[str, float]:
    out = {}
    for x, by in rat.items():
        alone = by.get("alone", [])
        if len(alone) < min_steps:
            continue
        base = statistics.median(alone)
        for y, rs in by.items():
            if y != "alone" and len(rs) >= min_steps:
                out[f"{x}|{y}"] = round(statistics.median(rs) / base, 3)
    return dict(sorted(out.items()))


def from_run(measured: dict, logs: str, table: dict, modes=None, min_cover: float = 0.8) -> tuple[dict, dict]:
    """(cross_slowdown, sample counts) from the modes' step logs of one `bench serve` run."""
    sets = {r: tuple(c) for r, c in (measured.get("cpus") or {}).items()}
    if len(set(sets.values())) < 2:
        raise ValueError("the benchmark did not pin its services to separate core sets")
    runs: dict[str, dict[str, list]] = {}  # mode -> {role: its steps}
    for mode, fig, role, path in service_logs(measured, logs, modes):
        if role in sets:
            runs.setdefault(mode, {})[role] = _steps(path, tuple(fig["window"]))
    if not runs:
        raise ValueError(f"no step logs of the benchmark's services in {logs} (run it with PDDJAX_STEP_LOG)")
    rat = ratios(list(runs.values()), sets, table, min_cover)
    return slowdowns(rat), {x: {y: len(v) for y, v in by.items()} for x, by in rat.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.hostlab.interference", description=__doc__.split("\n")[0])
    add_run_args(ap, calibration_required=True)
    ap.add_argument("--modes", help="comma list (default: every mode with logs)")
    ap.add_argument("--json", help="write the calibration with this run's cross_slowdown merged in")
    args = ap.parse_args(argv)
    try:
        measured, table = read_run(args)
        cross, counts = from_run(measured, args.logs, table, args.modes.split(",") if args.modes else None)
    except (OSError, json.JSONDecodeError, ValueError) as e:
        print(f"interference: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"cross_slowdown": cross, "steps": counts}, indent=1))
    if args.json:
        with open(args.calibration, encoding="utf-8") as f:
            cal = json.load(f)
        cal["cross_slowdown"] = {**cal.get("cross_slowdown", {}), **cross}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(cal, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
