"""Sum a compile log (tools/compile_log/sitecustomize.py): compiles and seconds by test file and
by program, and the same program compiled more than once (wasted seconds).

    python -m tools.compile_log.report DIR [--top N] [--json F]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys


def read(folder: str) -> list[dict]:
    return [json.loads(line) for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))) for line in open(path)]


def test_file(rec: dict) -> str:
    return rec["test"].split("::")[0] if rec["test"] else f"(outside a test: {rec['argv'][:40]})"


def summary(recs: list[dict]) -> dict:
    """-> {"compiles", "seconds", "cpu", "by_file", "by_program", "repeated"} (seconds per group,
    repeated: each program hash compiled n > 1 times, with the seconds of all but the first)."""
    by_file, by_program = collections.Counter(), collections.defaultdict(lambda: [0, 0.0])
    by_hash = collections.defaultdict(list)
    for r in recs:
        by_file[test_file(r)] += r["s"]
        by_program[r["name"]][0] += 1
        by_program[r["name"]][1] += r["s"]
        by_hash[r["hash"]].append(r)
    repeated = [{"program": rs[0]["name"], "times": len(rs), "wasted_s": sum(r["s"] for r in rs[1:]),
                 "files": sorted({test_file(r) for r in rs})} for rs in by_hash.values() if len(rs) > 1]
    return {"compiles": len(recs), "seconds": sum(r["s"] for r in recs), "cpu": sum(r["cpu"] for r in recs),
            "by_file": dict(by_file.most_common()),
            "by_program": {k: {"compiles": n, "seconds": s} for k, (n, s) in
                           sorted(by_program.items(), key=lambda kv: -kv[1][1])},
            "repeated": sorted(repeated, key=lambda r: -r["wasted_s"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.compile_log.report", description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--json", help="write the whole summary here")
    args = ap.parse_args(argv)
    recs = read(args.folder)
    if not recs:
        print(f"no compiles logged under {args.folder}", file=sys.stderr)
        return 1
    s = summary(recs)
    print(f"{s['compiles']} compiles, {s['seconds']:.0f} s summed over processes ({s['cpu']:.0f} CPU s)")
    print("\nby test file (s):")
    for name, sec in list(s["by_file"].items())[:args.top]:
        print(f"  {sec:7.1f}  {name}")
    print("\nby program (compiles, s):")
    for name, v in list(s["by_program"].items())[:args.top]:
        print(f"  {v['compiles']:5d} {v['seconds']:7.1f}  {name}")
    wasted = sum(r["wasted_s"] for r in s["repeated"])
    print(f"\nthe same program compiled again: {len(s['repeated'])} programs, {wasted:.0f} s")
    for r in s["repeated"][:args.top]:
        print(f"  {r['wasted_s']:6.1f} s  x{r['times']}  {r['program']}  {', '.join(r['files'][:3])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
