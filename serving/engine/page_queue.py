"""Requests waiting for KV pages: a bounded FIFO per engine service (P's Prefill, RLD's and
MD's Reserve), so a burst beyond the pool waits for pages to free, as in vLLM, SGLang and TGI,
instead of failing.

`admit(fn, need_pages, timeout)` runs `fn` (an engine-thread admission that raises OutOfPages)
at once when nobody waits; otherwise, or when it does not fit, the request joins the queue.
Only the head retries: when the engine thread reports that the pages it needs may be free
(`on_engine`, after each step and each release) or every POLL_S (a pool that frees with no
step running), so a waiting queue costs one engine call per retry, not one per waiter. The
head that fits leaves and the next becomes head at once (several may fit after one release).
A full queue raises QueueFull (the caller answers RESOURCE_EXHAUSTED); a request that waited
past its deadline raises TimeoutError (DEADLINE_EXCEEDED); one that can never fit is refused
before it queues (PagedEngine.add's ValueError: INVALID_ARGUMENT). `REFUSALS` is that mapping,
the one P's Prefill and RLD / MD's Reserve answer with (`refusal_status`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import TYPE_CHECKING

import grpc

from pddjax import env
from pddjax.kv.allocator import OutOfPages

if TYPE_CHECKING:
    from serving.engine.worker import EngineWorker

MAX_WAIT_S = 600.0  # a request that brings no deadline waits at most this long
POLL_S = 0.05  # the head retries at least this often


class QueueFull(Exception):
    """The page queue holds max_waiting requests already (one sentence)."""


# what `admit` raises when it refuses a request -> the status the RPC answers with (one sentence: str(e))
REFUSALS: dict[type[Exception], grpc.StatusCode] = {
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,  # too many wait already
    TimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,  # waited past the request's deadline
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,  # can never fit (PagedEngine.add)
}
REFUSED = tuple(REFUSALS)  # for `except REFUSED as e`


def refusal_status(e: Exception) -> grpc.StatusCode:
    """The status of a refused admission (`e` one of REFUSED)."""
    return next(code for kind, code in REFUSALS.items() if isinstance(e, kind))


@dataclasses.dataclass(eq=False)
class Waiter:
    need_pages: int  # pages the request needs at most (no prefix-cache hit)
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class PageQueue:
    def __init__(self, worker: EngineWorker, role: str, max_waiting: int | None = None):
        # requests queued per service at most (default: PDDJAX_MAX_WAITING)
        self.worker, self.role = worker, role
        self.max_waiting = env.MAX_WAITING.get() if max_waiting is None else max_waiting
        self.waiting: collections.deque[Waiter] = collections.deque()

    def __len__(self) -> int:
        return len(self.waiting)

    async def admit(self, fn, need_pages: int, timeout: float | None):
        """-> (fn(engine)'s result, seconds waited). Raises QueueFull, TimeoutError, or what fn raises
        (but OutOfPages, which makes it wait)."""
        if not self.waiting:
            try:
                return await self.worker.call(fn), 0.0
            except OutOfPages:
                pass
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"the {self.role} pool is full and {len(self.waiting)} requests already wait for pages")
        t0 = time.monotonic()
        end = t0 + (MAX_WAIT_S if timeout is None else min(timeout, MAX_WAIT_S))
        w = Waiter(need_pages)
        self.waiting.append(w)
        try:
            while True:
                if self.waiting[0] is w:
                    try:
                        result = await self.worker.call(fn)
                    except OutOfPages:
                        pass
                    else:
                        return result, time.monotonic() - t0
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no pages freed on {self.role} within {time.monotonic() - t0:.1f} s")
                w.wake.clear()
                try:
                    await asyncio.wait_for(w.wake.wait(), min(left, POLL_S) if self.waiting[0] is w else left)
                except TimeoutError:
                    pass
        finally:
            self.waiting.remove(w)
            if self.waiting:  # the next one is head now: it tries at once
                self.waiting[0].wake.set()

    def on_engine(self, engine) -> None:
        """Engine thread, after a step or a release: wake the head if its pages may be free now."""
        try:
            head = self.waiting[0]  # (read from the engine thread: the loop may empty it meanwhile)
        except IndexError:
            return
        if engine.allocator.num_free + engine.radix.num_evictable >= head.need_pages:
            self.worker.post(head.wake.set)
