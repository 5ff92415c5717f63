"""The discrete-event core: a clock and a heap of (time, seq, callback, args).

Ties run in scheduling order (seq). Scheduling in the past raises: no event may run before
its cause, and tests rely on `now` never going backwards. Cancelling is the caller's job:
components keep a version number and ignore stale callbacks (cheaper than heap deletion).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable

EPS = 1e-9  # tolerance for float round-off in event times


class SimError(Exception):
    """An invariant of the simulation was violated (a bug, not a user error)."""


class EventLoop:
    """Heap-ordered event loop with a monotone clock."""

    def __init__(self):
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = itertools.count()
        self.events_run = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        """Run fn(*args) at time t (t >= now)."""
        if t < self.now - EPS or math.isnan(t):
            raise SimError(f"event scheduled at {t} before now {self.now}")
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        """Run fn(*args) dt seconds from now (dt >= 0)."""
        self.at(self.now + dt, fn, *args)

    def run(self, until: float = math.inf, max_events: int = 50_000_000) -> None:
        """Run events in time order until the heap is empty or the next is after `until`."""
        heap = self._heap
        while heap and heap[0][0] <= until:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            fn(*args)
            self.events_run += 1
            if self.events_run > max_events:
                raise SimError("event budget exhausted (runaway simulation?)")

    @property
    def pending(self) -> int:
        return len(self._heap)


class OneAtATime:
    """Items handled strictly one after another, in order: `start(item, done)` begins one and
    calls `done()` when it has finished; the next starts then (a thread's queue, a sync line)."""

    def __init__(self, start: Callable[[object, Callable[[], None]], None]):
        self._start = start
        self._q: deque = deque()
        self.busy = False

    def push(self, item) -> None:
        self._q.append(item)
        if not self.busy:
            self._next()

    def _next(self) -> None:
        if not self._q:
            self.busy = False
            return
        self.busy = True
        self._start(self._q.popleft(), self._next)
