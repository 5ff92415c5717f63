"""Benchmark output: the figures as indented JSON on stdout, and optionally in a file."""

from __future__ import annotations

import json


def write_figures(figures: dict, path: str | None) -> None:
    print(json.dumps(figures, indent=2))
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=2)
