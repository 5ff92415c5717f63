"""An engine thread's timeline, for checking the simulator's host model against a real run.

Off unless `PDDJAX_STEP_LOG=DIR` is set in a service's environment. Then the service's
engine thread appends one JSON line per step and per command to `DIR/<worker>-<pid>.jsonl`:

    {"t": wall-clock end (s), "k": "step", "wall": s, "cpu": engine thread CPU s,
     "shape": [T, B, MP, Q, rows]}
    {"t": ..., "k": "cmd", "wall": s, "cpu": s, "name": the command's function name}
    {"t": ..., "k": "threads", "engine": s, "main": s, "other": s, "names": {comm: s}}   (at
        every flush: the process's CPU so far by thread: engine thread, main = asyncio, other =
        XLA + gRPC, these also by the kernel's thread name)

`cpu` is the engine thread's own CPU time (time.thread_time): on CPU, XLA runs a step's
kernels on its own threads too, so `wall` is the figure to compare with a measured step
table, `cpu` says how much of it the Python side took. Lines are buffered and flushed
every 256 entries or 2 s and at close; `python -m tools.hostlab.steplog` reads them (tools/hostlab/README.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from pddjax import env


def stat_cpu_s(path: str) -> tuple[str, float] | None:
    """(kernel name, user + system CPU seconds) from a /proc/.../stat file; None if it is gone."""
    try:
        with open(path) as f:
            head, tail = f.read().rsplit(")", 1)
    except OSError:
        return None
    fields = tail.split()
    return head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class StepLog:
    def __init__(self, path: str):
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115  (closed by close())
        self._lines: list[str] = []
        self._flushed = time.monotonic()
        self.engine_tid = 0  # the engine thread's native id (set by it)

    @classmethod
    def from_env(cls, name: str) -> StepLog | None:
        folder = env.STEP_LOG.get()
        if not folder:
            return None
        os.makedirs(folder, exist_ok=True)
        return cls(os.path.join(folder, f"{name}-{os.getpid()}.jsonl"))

    @contextlib.contextmanager
    def timed(self, name: str, shape=None):
        """Log the block as a command `name`, or as a step when `shape()` gives its shape
        afterwards. A block that raises is not logged."""
        start = time.perf_counter(), time.thread_time()
        yield
        if shape is None:
            self._add({"k": "cmd", "name": name}, start)
        else:
            self._add({"k": "step", "shape": list(shape())}, start)

    def _add(self, entry: dict, start: tuple[float, float]) -> None:
        wall, cpu = time.perf_counter() - start[0], time.thread_time() - start[1]
        entry.update(t=round(time.time(), 4), wall=round(wall, 6), cpu=round(cpu, 6))
        self._lines.append(json.dumps(entry, separators=(",", ":")))
        if len(self._lines) >= 256 or time.monotonic() - self._flushed > 2.0:
            self.flush()

    def threads_cpu(self) -> None:
        """Cumulative CPU seconds of this process's threads: the engine thread, the main
        (asyncio) thread and all others (XLA's compute pool, gRPC's own threads)."""
        out = {"engine": 0.0, "main": 0.0, "other": 0.0}
        names: dict[str, float] = {}
        for tid in os.listdir("/proc/self/task"):
            got = stat_cpu_s(f"/proc/self/task/{tid}/stat")
            if got is None:
                continue  # the thread ended
            name, cpu = got
            who = "engine" if int(tid) == self.engine_tid else "main" if int(tid) == os.getpid() else "other"
            out[who] += cpu
            if who == "other":  # by the kernel's thread name (comm): tf_XLAEigen, grpc_*, ...
                names[name] = names.get(name, 0.0) + cpu
        self._lines.append(json.dumps({"k": "threads", "t": round(time.time(), 4),
                                       **{k: round(v, 2) for k, v in out.items()},
                                       "names": {k: round(v, 2) for k, v in names.items()}}))

    def flush(self) -> None:
        if os.path.isdir("/proc/self/task"):
            self.threads_cpu()
        if self._lines:
            self._f.write("\n".join(self._lines) + "\n")
            self._f.flush()
            self._lines.clear()
        self._flushed = time.monotonic()

    def close(self) -> None:
        self.flush()
        self._f.close()
