"""Where a service's start goes: the phases its caller times (JAX set up, weights, the step
shapes built before SERVING, the KV copies) and, inside them, JAX's own compile events summed
(tracing, lowering to MLIR, the backend compile, reads of the persistent compilation cache,
its hits and misses), from `jax.monitoring` listeners installed once per process.

`report()` is a flat dict of seconds and counts (JSON-ready), written into a service's ready
file as `startup` and read by `pddjax bench startup` (serving/bench/startup). JAX reports
the backend compile with the cache read inside it: `xla_compile_s` is the difference, the time
XLA itself compiled (0 on a warm cache).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time

DURATIONS = {  # jax.monitoring duration event -> report key
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "backend_s",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read_s",
}
COUNTS = {"/jax/compilation_cache/cache_hits": "cache_hits", "/jax/compilation_cache/cache_misses": "cache_misses"}

_lock = threading.Lock()
_sums: collections.Counter = collections.Counter()
_installed = False


def install() -> None:
    """Listen to JAX's compile events (once per process; later calls do nothing)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    import jax

    def on_duration(event: str, duration: float, **_) -> None:
        key = DURATIONS.get(event)
        if key:
            with _lock:
                _sums[key] += duration

    def on_event(event: str, **_) -> None:
        key = COUNTS.get(event)
        if key:
            with _lock:
                _sums[key] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)


def jax_totals() -> dict[str, float]:
    """JAX's compile events so far in this process (every key present, 0 when none)."""
    with _lock:
        got = dict(_sums)
    out = {k: round(got.get(k, 0.0), 4) for k in DURATIONS.values()}
    out.update({k: int(got.get(k, 0)) for k in COUNTS.values()})
    out["xla_compile_s"] = round(max(0.0, out["backend_s"] - out["cache_read_s"]), 4)
    return out


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere): the interpreter and the
    imports before a clock could start."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Phases of one start, in order, each timed once (`with clock.phase("weights_s"): ...`);
    `imports_s` is the process's age when the clock started."""

    def __init__(self):
        self.t0 = time.perf_counter()
        age = process_age()
        self.phases: dict[str, float] = {} if age is None else {"imports_s": round(age, 3)}

    @contextlib.contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = round(self.phases.get(name, 0.0) + time.perf_counter() - t, 4)

    def report(self, **extra) -> dict:
        """{phases..., total_s (the process's age: imports and every phase), JAX's totals, extra}."""
        total = time.perf_counter() - self.t0 + self.phases.get("imports_s", 0.0)
        return {**self.phases, "total_s": round(total, 4), **jax_totals(), **extra}


def phase(clock: StartupClock | None, name: str):
    """`clock.phase(name)`, or nothing without a clock."""
    return clock.phase(name) if clock is not None else contextlib.nullcontext()
