"""Where a service's CPU went in a real run: its engine thread's step log against the host model.

    PDDJAX_STEP_LOG=DIR pddjax bench serve --quick --json bench.json
    python -m tools.hostlab.steplog --measured bench.json --logs DIR [--calibration host.json]

For every mode and engine service of the benchmark (its JSON records each service's pid and
the measured phase's wall-clock window), from the service's log (`serving/engine/steplog.py`):
- the process's CPU seconds in the window (the benchmark's `cpu_s`) and how its threads
  split it: engine thread, main (asyncio: gRPC handlers, streams, KV push), other (XLA's
  compute pool, gRPC's own threads);
- the engine steps run in the window: count, wall seconds, the engine thread's own CPU in
  them, and what the calibration's measured step table says the same shapes cost alone
  (`table_s`, over the steps whose shape it has; `covered` = their share);
- commands and step callbacks on the engine thread: wall seconds by name.
The simulator charges a service its steps (step table), KV export / serialization / import
per token and nothing else, so `cpu_s - steps - commands` is what it does not model.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict


def read_log(path: str) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut short when the process was stopped
    return out


def _flat(snap: dict) -> dict[str, float]:
    """A threads entry as {engine, main, other, other:<thread name>: cumulative CPU s}."""
    out = {k: snap[k] for k in ("engine", "main", "other")}
    out.update({f"other:{n}": v for n, v in snap.get("names", {}).items()})
    return out


def _threads_at(entries: list[dict], t: float) -> dict[str, float]:
    """Cumulative thread CPU at time t, linearly between the two snapshots around it."""
    snaps = [e for e in entries if e["k"] == "threads"]
    if not snaps:
        return {}
    before = [e for e in snaps if e["t"] <= t]
    after = [e for e in snaps if e["t"] > t]
    a = _flat(before[-1]) if before else None
    b = _flat(after[0]) if after else None
    if a is None or b is None:
        return a or b
    f = (t - before[-1]["t"]) / max(after[0]["t"] - before[-1]["t"], 1e-9)
    return {k: a.get(k, 0.0) + f * (b[k] - a.get(k, 0.0)) for k in b}


def summarize(entries: list[dict], window: tuple[float, float], table: dict) -> dict:
    """Steps, commands and thread CPU of one service inside the wall-clock window."""
    t0, t1 = window
    inside = [e for e in entries if t0 <= e.get("t", 0) <= t1]
    steps = [e for e in inside if e["k"] == "step"]
    covered = [e for e in steps if tuple(e["shape"][:4]) in table]
    cmds: dict[str, float] = defaultdict(float)
    for e in inside:
        if e["k"] == "cmd":
            cmds[e["name"]] += e["wall"]
    a, b = _threads_at(entries, t0), _threads_at(entries, t1)
    shapes: dict[tuple, int] = defaultdict(int)
    for e in steps:
        shapes[tuple(e["shape"][:4])] += 1
    return {
        "steps": len(steps),
        "step_wall_s": sum(e["wall"] for e in steps),
        "step_cpu_s": sum(e["cpu"] for e in steps),
        "covered": len(covered) / len(steps) if steps else 1.0,
        "covered_wall_s": sum(e["wall"] for e in covered),
        "table_s": sum(table[tuple(e["shape"][:4])] for e in covered),
        "commands_s": dict(sorted(cmds.items(), key=lambda kv: -kv[1])),
        "threads_s": {k: b[k] - a.get(k, 0.0) for k in b} if b else {},
        "shapes": {",".join(map(str, k)): n for k, n in sorted(shapes.items(), key=lambda kv: -kv[1])},
    }


def service_logs(measured: dict, logs: str, modes=None):
    """(mode, its figures, role, log path) for every service of a `bench serve` run (its JSON
    records pids and the measured window) that left a step log in `logs`."""
    for mode, fig in measured.get("modes", {}).items():
        if (modes and mode not in modes) or not fig.get("pids") or not fig.get("window"):
            continue
        for role, pid in fig["pids"].items():
            paths = glob.glob(os.path.join(logs, f"*-{pid}.jsonl"))
            if paths:
                yield mode, fig, role, paths[0]


def analyse(measured: dict, logs: str, table: dict) -> dict:
    """{mode: {role: summary + cpu_s}} for the modes whose services left a log in `logs`."""
    out: dict = {}
    for mode, fig, role, path in service_logs(measured, logs):
        s = summarize(read_log(path), tuple(fig["window"]), table)
        s["cpu_s"] = (fig.get("cpu_s") or {}).get(role)
        out.setdefault(mode, {})[role] = s
    return out


def table_of(path: str | None) -> dict:
    """{(T, B, width, Q): seconds} from a calibration JSON's measured step_table ({} without one)."""
    if not path:
        return {}
    with open(path, encoding="utf-8") as f:
        cal = json.load(f)
    return {tuple(int(x) for x in row[:4]): row[4] / 1e3 for row in cal.get("step_table", [])}


def add_run_args(ap: argparse.ArgumentParser, calibration_required: bool = False) -> None:
    """The inputs of the step-log tools: a `bench serve` run, its log folder, a step table."""
    ap.add_argument("--measured", required=True, help="bench serve JSON (with pids and window per mode)")
    ap.add_argument("--logs", required=True, help="the PDDJAX_STEP_LOG folder of that run")
    ap.add_argument("--calibration", required=calibration_required,
                    help="calibration JSON with a step_table (python -m tools.hostlab.step_table)")


def read_run(args) -> tuple[dict, dict]:
    """(the run's JSON, the step table) named by `add_run_args`' options; OSError / JSONDecodeError."""
    with open(args.measured, encoding="utf-8") as f:
        measured = json.load(f)
    return measured, table_of(args.calibration)


def print_report(result: dict, file=sys.stdout) -> None:
    print("| mode | service | CPU s | engine / main / other thread s | steps | step wall s | step thread CPU s "
          "| table s (covered wall s, share) | commands s (top 3) |", file=file)
    print("|---|---|---:|---|---:|---:|---:|---|---|", file=file)
    for mode, roles in result.items():
        for role, s in roles.items():
            th = s["threads_s"]
            top = ", ".join(f"{k} {v:.1f}" for k, v in list(s["commands_s"].items())[:3])
            print(f"| {mode} | {role} | {s['cpu_s']} | {th.get('engine', 0):.1f} / {th.get('main', 0):.1f} / "
                  f"{th.get('other', 0):.1f} | {s['steps']} | {s['step_wall_s']:.1f} | {s['step_cpu_s']:.1f} | "
                  f"{s['table_s']:.1f} ({s['covered_wall_s']:.1f}, {100 * s['covered']:.0f}%) | {top} |", file=file)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.hostlab.steplog", description=__doc__.split("\n")[0])
    add_run_args(ap)
    ap.add_argument("--json", help="write the summaries here")
    args = ap.parse_args(argv)
    try:
        measured, table = read_run(args)
    except (OSError, json.JSONDecodeError) as e:
        print(f"steplog: cannot read the inputs: {e}", file=sys.stderr)
        return 2
    result = analyse(measured, args.logs, table)
    if not result:
        print(f"steplog: no service of {args.measured} left a log in {args.logs} "
              "(run the benchmark with PDDJAX_STEP_LOG set)", file=sys.stderr)
        return 2
    print_report(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
