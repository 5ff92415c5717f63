"""Collectives in a compiled executable's HLO text, counted (`bench engine --tensor-parallel`).

`count(text)` -> per kind (all-reduce, all-gather, reduce-scatter, collective-permute,
all-to-all): `static`, the instructions written in the program, and `per_step`, how many run
in one call: an instruction inside a while loop's body (the layer scan) counts once per trip
(XLA's `known_trip_count`; nested loops multiply). An async pair (`-start` / `-done`) is one.
"""

from __future__ import annotations

import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"=\s*\S.*?\s(" + "|".join(KINDS) + r")(-start)?\(")
_WHILE = re.compile(r"\swhile\(.*?body=%?([\w.\-]+)")
_TRIPS = re.compile(r'known_trip_count["\s:={]*"?n"?\s*[:=]\s*"?(\d+)')
_CALLS = re.compile(r"(?:to_apply|calls|condition|branch_computations)=\{?%?([\w.\-, %]+)\}?")


def _computations(text: str) -> dict[str, list[str]]:
    comps, name = {}, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            name = m.group(1)
            comps[name] = []
        elif name is not None:
            if line.strip() == "}":
                name = None
            else:
                comps[name].append(line)
    return comps


def count(text: str) -> dict[str, dict[str, int]]:
    """{kind: {"static": n, "per_step": m}} for every kind in KINDS."""
    comps = _computations(text)
    entry = next((m.group(1) for line in text.splitlines() if line.startswith("ENTRY")
                  for m in [_COMPUTATION.match(line)] if m), None)
    static = {k: 0 for k in KINDS}
    for lines in comps.values():
        for line in lines:
            m = _OP.search(line)
            if m:
                static[m.group(1)] += 1
    per_step = {k: 0 for k in KINDS}

    def walk(name: str, times: int, depth: int = 0) -> None:
        if name not in comps or depth > 32:
            return
        for line in comps[name]:
            m = _OP.search(line)
            if m:
                per_step[m.group(1)] += times
            w = _WHILE.search(line)
            if w:
                trips = _TRIPS.search(line)
                walk(w.group(1), times * (int(trips.group(1)) if trips else 1), depth + 1)
                continue
            for c in _CALLS.finditer(line):
                for callee in c.group(1).replace("%", "").split(","):
                    walk(callee.strip(), times, depth + 1)

    if entry:
        walk(entry, 1)
    return {k: {"static": static[k], "per_step": per_step[k]} for k in KINDS}
