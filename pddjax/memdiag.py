"""Opt-in heap growth diagnostics for a long-running service (the soak's leak hunts).

With `PDDJAX_TRACEMALLOC=N` (frames per traceback) in its environment, a service starts
`tracemalloc` (only the role named by `PDDJAX_TRACEMALLOC_ROLE`, if set: tracing slows a
process several times); each `kill -USR2 PID` then writes to stderr the 15 source lines whose live
Python allocations grew most since the previous signal (the first signal: since start).
Native memory (XLA executables, gRPC core) is not traced: compare with RSS.
"""

from __future__ import annotations

import os
import signal
import sys
import tracemalloc

from pddjax import env

_last: list = [None]


def _report(_signum=None, _frame=None) -> None:
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    base = _last[0]
    stats = snap.compare_to(base, "lineno") if base is not None else snap.statistics("lineno")
    total = sum(s.size for s in snap.statistics("filename"))
    print(f"memdiag pid {os.getpid()}: {total / 2**20:.1f} MiB traced; top growth:", file=sys.stderr)
    for s in stats[:15]:
        print(f"  {s}", file=sys.stderr)
    sys.stderr.flush()
    _last[0] = snap


def install(role: str = "") -> bool:
    """Start tracing and hook SIGUSR2 if PDDJAX_TRACEMALLOC asks for it; -> whether it did."""
    frames, only = env.TRACEMALLOC.get(), env.TRACEMALLOC_ROLE.get()
    if frames is None or (only and only != role):
        return False
    tracemalloc.start(frames)
    signal.signal(signal.SIGUSR2, _report)
    return True
