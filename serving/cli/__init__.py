"""`pddjax` command line: one subcommand per module, each registered by a small function.

A subcommand module exposes `register(subparsers)` which adds its parser and sets
`func=handler` where `handler(args) -> int` returns the exit code. Errors meant for the
user raise `UserError(sentence)`: printed as one line on stderr, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pddjax import env
from pddjax.errors import UserError

# Modules that contribute subcommands (imported lazily so `pddjax --help` stays fast).
_SUBCOMMAND_MODULES = [
    "serving.cli.generate",
    "serving.cli.bench",
    "pddjax.sim.cli",
    "serving.cli.serve",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pddjax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        env.check()
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"pddjax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
