"""One machine whose CPU cores all services share: processor sharing of engine steps.

`pddjax bench serve` runs P, RLD, MD and the router as processes on one host. An engine step
that takes `work_s` seconds on the idle host (what `bench engine` measured) runs slower
while other engines step at the same time. Each job asks for `cores` cores (how many it
keeps busy when alone: 1 for a single-threaded job, up to the host's count for an XLA step
that parallelizes its matmuls). With demand D = sum of the running jobs' `cores` on a host
of C cores, every job progresses at rate min(1, C / D): k single-core jobs on C cores each
take work_s * max(1, k / C); k jobs that each want the whole host take work_s * k.
`background` cores of demand from other processes (not simulated) count in D all the time.

Hosts that are core sets of one machine (`bench serve` pins services) do not share cores but
do share its memory system: `couple(hosts, cross)` makes every job of class x (`kind`: a
step's `step_class`) run `cross["x|y"]` times slower while another of the hosts runs a job of
class y (the largest factor if several; measured by the host lab, `tools/hostlab/README.md`).

Implemented with a virtual clock, as the WAN line: V advances at the common rate, and a job
of w seconds started at V0 ends when V = V0 + w; a start or an end changes the rate (of the
coupled hosts too) and reschedules the next completion. `busy_by` integrates the cores in use
(CPU seconds: a job slowed by the memory system keeps its core busy longer).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from pddjax.sim.events import EPS, EventLoop, OneAtATime, SimError

SMALL_TOKENS = 64  # a step of at most this many tokens with a multi-token row is "small"
WIDE_ROWS = 3  # a decode step of at least this many rows is "decode4"


def step_class(tokens: int, rows: int, decode_only: bool) -> str:
    """The class of a step of `tokens` tokens in `rows` rows (decode_only: every row one token),
    the key of `cross_slowdown`: "decode" (one or two one-token rows), "decode4" (three or
    more), "small" (a chunk of at most 64 tokens), "large" (more)."""
    if decode_only:
        return "decode4" if rows >= WIDE_ROWS else "decode"
    return "small" if tokens <= SMALL_TOKENS else "large"


class Job:
    __slots__ = ("cores", "done", "end_v", "kind", "on_done", "owner", "work")

    def __init__(self, work: float, cores: float, on_done: Callable[[], None], owner: str, kind: str = ""):
        self.work, self.cores, self.on_done, self.owner, self.kind = work, cores, on_done, owner, kind
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
        self.peers: list[Host] = []  # other core sets of the same machine (`couple`)
        self.cross: dict[str, float] = {}  # "x|y" -> slowdown of class x while a peer runs class y
        self._kinds: dict[str, int] = {}  # running jobs per class (kind)

    # ---- queries -------------------------------------------------------------------------
    def cpu_rate(self) -> float:
        """Share of its cores every running job gets now (processor sharing)."""
        d = self._demand + self.background
        return 1.0 if d <= self.cores + EPS else self.cores / d

    def interference(self) -> float:
        """How many times slower the memory system makes this host's jobs now (>= 1)."""
        if not self.cross or not self._kinds:
            return 1.0
        slow = [self.cross.get(f"{x}|{y}", 1.0) for x in self._kinds for p in self.peers for y in p._kinds]
        return max([1.0, *slow])

    def rate(self) -> float:
        """Progress per second of every running job now (1 = as fast as alone on an idle host)."""
        return self.cpu_rate() / self.interference()

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
    def run(self, work_s: float, cores: float, on_done: Callable[[], None], owner: str = "", kind: str = "") -> Job:
        """Start a job of `work_s` solo seconds that keeps `cores` cores busy when alone
        (`kind`: its class for the memory coupling, "" for none)."""
        if work_s < 0 or cores <= 0:
            raise SimError(f"job of {work_s} s on {cores} cores")
        cores = min(cores, self.cores)
        job = Job(work_s, cores, on_done, owner, kind)
        for p in self.peers:
            p._advance()  # at their rates before this job starts
        self._advance()
        job.end_v = self._v + work_s
        heapq.heappush(self._jobs, (job.end_v, next(self._seq), job))
        self._demand += cores
        if kind:
            self._kinds[kind] = self._kinds.get(kind, 0) + 1
        self.jobs_run += 1
        self._reschedule()
        if kind:
            for p in self.peers:
                p._reschedule()
        return job

    def _advance(self) -> None:
        now = self.loop.now
        if self._jobs:
            rate, cpu = self.rate(), self.cpu_rate()
            self._v += (now - self._t) * rate
            for _, _, job in self._jobs:
                self.busy_by[job.owner] = self.busy_by.get(job.owner, 0.0) + (now - self._t) * job.cores * cpu
        self._t = now

    def _reschedule(self) -> None:
        self._version += 1
        if self._jobs:
            dt = max(0.0, (self._jobs[0][0] - self._v) / self.rate())
            self.loop.after(dt, self._complete, self._version)

    def _complete(self, version: int) -> None:
        if version != self._version:
            return
        for p in self.peers:
            p._advance()
        self._advance()
        finished = []
        while self._jobs and self._jobs[0][0] <= self._v + EPS:
            _, _, job = heapq.heappop(self._jobs)
            self._demand -= job.cores
            if job.kind:
                self._kinds[job.kind] -= 1
                if not self._kinds[job.kind]:
                    del self._kinds[job.kind]
            job.done = True
            finished.append(job)
        if not self._jobs:
            self._v, self._demand = 0.0, 0.0  # idle: restart the virtual clock (keeps floats small)
        self._reschedule()
        if any(j.kind for j in finished):
            for p in self.peers:
                p._reschedule()
        for job in finished:
            job.on_done()

    def check_integrity(self) -> None:
        demand = sum(j.cores for _, _, j in self._jobs)
        if abs(demand - self._demand) > 1e-6:
            raise SimError(f"host demand {self._demand} != sum of running jobs {demand}")
        kinds: dict[str, int] = {}
        for _, _, j in self._jobs:
            if j.kind:
                kinds[j.kind] = kinds.get(j.kind, 0) + 1
        if kinds != self._kinds:
            raise SimError(f"host job classes {self._kinds} != those of its running jobs {kinds}")
        if self in self.peers:
            raise SimError("a host is coupled to itself")


def couple(hosts: list[Host], cross: dict[str, float]) -> None:
    """Core sets of one machine: each host's jobs slow down by `cross` while the others run."""
    if any(v <= 0 for v in cross.values()):
        raise ValueError("cross slowdowns must be positive")
    for h in hosts:
        h.peers = [p for p in hosts if p is not h]
        h.cross = dict(cross)


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
