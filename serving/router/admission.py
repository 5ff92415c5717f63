"""The router's front door: bounded admission and the client's deadline (no JAX, no engines).

Admission: at most `max_inflight` requests are served at once and at most `max_queue` wait
(FIFO) for a slot; a request past both is refused at once with RESOURCE_EXHAUSTED and a
sentence (nothing reserved anywhere, nothing else affected). A waiting request whose deadline
passes leaves the queue with DEADLINE_EXCEEDED. A freed slot goes straight to the oldest
waiter, so `inflight` never exceeds the limit.

Deadline: the time left on the client's Generate (`context.time_remaining()`), kept as an
absolute monotonic time so every downstream RPC (Reserve, Prefill, Decode, Handoff) gets
`timeout = what is left`; no deadline -> the server's default; a client's deadline past the
server's maximum (`[router] max_deadline_s`) is cut to it, so no caller holds a slot longer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

import grpc


class Refused(Exception):
    """A request turned away before it was served: `code` (grpc.StatusCode) and one sentence."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message, self.stage = code, message, "admission"


class Deadline:
    def __init__(self, remaining_s: float | None):
        self.at = None if remaining_s is None else time.monotonic() + max(remaining_s, 0.0)

    @classmethod
    def of(cls, context, default_s: float | None = None, max_s: float | None = None) -> Deadline:
        """The client's deadline, else `default_s` from now (the server's bound on every request),
        at most `max_s` from now."""
        try:
            remaining = context.time_remaining()
        except Exception:  # noqa: BLE001  (a context without deadlines)
            remaining = None
        return cls.capped(default_s if remaining is None else remaining, max_s)

    @classmethod
    def capped(cls, remaining_s: float | None, max_s: float | None) -> Deadline:
        """`remaining_s` from now, at most `max_s` (None: no bound)."""
        if max_s is not None:
            remaining_s = max_s if remaining_s is None else min(remaining_s, max_s)
        return cls(remaining_s)

    def remaining(self) -> float | None:
        return None if self.at is None else max(self.at - time.monotonic(), 0.0)

    def timeout(self, cap: float | None = None) -> float | None:
        """The timeout for a downstream RPC: what is left, at most `cap`."""
        r = self.remaining()
        if r is None:
            return cap
        return r if cap is None else min(r, cap)

    def expired(self, slack_s: float = 0.0) -> bool:
        """Passed (or within `slack_s` of passing: gRPC's own timer may fire a little early)."""
        return self.at is not None and time.monotonic() >= self.at - slack_s


class Admission:
    def __init__(self, max_inflight: int, max_queue: int):
        self.max_inflight, self.max_queue = max_inflight, max_queue
        self.inflight = 0  # requests holding a slot
        self.waiters: collections.deque[asyncio.Future] = collections.deque()  # FIFO, a slot each when resolved
        self.refused = 0

    @property
    def queued(self) -> int:
        return sum(not f.done() for f in self.waiters)

    async def enter(self, deadline: Deadline) -> None:
        if self.inflight < self.max_inflight and not self.queued:
            self.inflight += 1
            return
        if self.queued >= self.max_queue:
            self.refused += 1
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the router is at capacity ({self.inflight} requests in flight, max_inflight "
                          f"{self.max_inflight}; {self.queued} waiting, max_queue {self.max_queue}): retry later")
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await asyncio.wait_for(fut, deadline.timeout())
        except TimeoutError:
            self._abandon(fut)
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
                          "the request's deadline passed while it waited for a router slot") from None
        except BaseException:
            self._abandon(fut)
            raise

    def _abandon(self, fut: asyncio.Future) -> None:
        """A waiter gives up; a slot handed to it in the same instant is passed on."""
        if fut.done() and not fut.cancelled():
            self.leave()
        else:
            fut.cancel()
            with contextlib.suppress(ValueError):
                self.waiters.remove(fut)

    def leave(self) -> None:
        while self.waiters:
            f = self.waiters.popleft()
            if not f.done():
                f.set_result(None)  # the slot moves to the oldest waiter
                return
        self.inflight -= 1

    def stats(self) -> dict:
        return {"inflight": self.inflight, "queued": self.queued, "refused": self.refused,
                "max_inflight": self.max_inflight, "max_queue": self.max_queue}

    def check_integrity(self) -> None:
        assert 0 <= self.inflight <= self.max_inflight, (self.inflight, self.max_inflight)
        assert self.queued <= self.max_queue, (self.queued, self.max_queue)
        assert not self.queued or self.inflight == self.max_inflight, "a request waits while a slot is free"
