"""One machine whose CPU cores all services share: processor sharing of engine steps.

`pddjax bench serve` runs P, RLD, MD and the router as processes on one host. An engine step
that takes `work_s` seconds on the idle host (what `bench engine` measured) runs slower
while other engines step at the same time. Each job asks for `cores` cores (how many it
keeps busy when alone: 1 for a single-threaded job, up to the host's count for an XLA step
that parallelizes its matmuls). With demand D = sum of the running jobs' `cores` on a host
of C cores, every job progresses at rate min(1, C / D): k single-core jobs on C cores each
take work_s * max(1, k / C); k jobs that each want the whole host take work_s * k.
`background` cores of demand from other processes (not simulated) count in D all the time.

Implemented with a virtual clock, as the WAN line: V advances at the common rate, and a job
of w seconds started at V0 ends when V = V0 + w; a start or an end changes the rate and
reschedules the next completion. `busy_s` integrates the cores in use (utilization).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from pddjax.sim.events import EPS, EventLoop, OneAtATime, SimError


class Job:
    __slots__ = ("cores", "done", "end_v", "on_done", "owner", "work")

    def __init__(self, work: float, cores: float, on_done: Callable[[], None], owner: str):
        self.work, self.cores, self.on_done, self.owner = work, cores, on_done, owner
        self.end_v = 0.0
        self.done = False


class Host:
    """`cores` shared cores; `run(work_s, cores, on_done)` starts a job at once."""

    def __init__(self, loop: EventLoop, cores: float, background: float = 0.0):
        if cores <= 0 or background < 0:
            raise ValueError("a host needs a positive number of cores and background load >= 0")
        self.loop, self.cores, self.background = loop, float(cores), float(background)
        self._v, self._t = 0.0, 0.0  # virtual seconds of solo work done per job, at time _t
        self._jobs: list[tuple[float, int, Job]] = []  # heap by end_v
        self._demand = 0.0
        self._seq = itertools.count()
        self._version = 0
        self.busy_by: dict[str, float] = {}  # integral of the cores in use, per job owner (CPU seconds)
        self.jobs_run = 0

    # ---- queries -------------------------------------------------------------------------
    def rate(self) -> float:
        """Progress per second of every running job now (1 = as fast as alone on an idle host)."""
        d = self._demand + self.background
        return 1.0 if d <= self.cores + EPS else self.cores / d

    def slowdown(self, extra_cores: float = 0.0) -> float:
        """How many times slower than alone a job would run if `extra_cores` more were asked."""
        d = self._demand + self.background + extra_cores
        return max(1.0, d / self.cores)

    def usage(self) -> dict[str, float]:
        """CPU seconds per job owner up to now."""
        self._advance()  # the pending completion stays valid: the rate has not changed
        return dict(self.busy_by)

    @property
    def busy_s(self) -> float:
        """Integral of the cores in use over time (up to the last start or end of a job)."""
        return sum(self.busy_by.values())

    @property
    def running(self) -> int:
        return len(self._jobs)

    # ---- mutations -----------------------------------------------------------------------
    def run(self, work_s: float, cores: float, on_done: Callable[[], None], owner: str = "") -> Job:
        """Start a job of `work_s` solo seconds that keeps `cores` cores busy when alone."""
        if work_s < 0 or cores <= 0:
            raise SimError(f"job of {work_s} s on {cores} cores")
        cores = min(cores, self.cores)
        job = Job(work_s, cores, on_done, owner)
        self._advance()
        job.end_v = self._v + work_s
        heapq.heappush(self._jobs, (job.end_v, next(self._seq), job))
        self._demand += cores
        self.jobs_run += 1
        self._reschedule()
        return job

    def _advance(self) -> None:
        now = self.loop.now
        if self._jobs:
            rate = self.rate()
            self._v += (now - self._t) * rate
            for _, _, job in self._jobs:
                self.busy_by[job.owner] = self.busy_by.get(job.owner, 0.0) + (now - self._t) * job.cores * rate
        self._t = now

    def _reschedule(self) -> None:
        self._version += 1
        if self._jobs:
            dt = max(0.0, (self._jobs[0][0] - self._v) / self.rate())
            self.loop.after(dt, self._complete, self._version)

    def _complete(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        finished = []
        while self._jobs and self._jobs[0][0] <= self._v + EPS:
            _, _, job = heapq.heappop(self._jobs)
            self._demand -= job.cores
            job.done = True
            finished.append(job)
        if not self._jobs:
            self._v, self._demand = 0.0, 0.0  # idle: restart the virtual clock (keeps floats small)
        self._reschedule()
        for job in finished:
            job.on_done()

    def check_integrity(self) -> None:
        demand = sum(j.cores for _, _, j in self._jobs)
        if abs(demand - self._demand) > 1e-6:
            raise SimError(f"host demand {self._demand} != sum of running jobs {demand}")


class SerialWorker:
    """One thread of a service (an asyncio loop, say): its jobs run one at a time, in order,
    each keeping `cores` cores busy on the host. Without a host every job is free."""

    def __init__(self, host: Host | None, cores: float = 1.0, name: str = ""):
        self.host, self.cores, self.name = host, cores, name
        self._queue = OneAtATime(self._start)

    def run(self, work_s: float, fn: Callable[[], None]) -> None:
        if self.host is None:
            fn()
        else:
            self._queue.push((work_s, fn))

    def _start(self, item: tuple[float, Callable[[], None]], done: Callable[[], None]) -> None:
        work, fn = item
        self.host.run(work, self.cores, lambda: (fn(), done()), self.name)
