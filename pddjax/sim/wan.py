"""A one-way network line: bandwidth, propagation latency, jitter, and how transfers share it.

Sharing:
- "fair" (default): processor sharing. All transfers in flight split the bandwidth equally,
  like long-lived TCP flows on a bottleneck. Implemented with a virtual clock: V grows at
  bw / n_active bytes per second, and a transfer of b bytes started at V0 ends when V = V0 + b.
- "fifo": one transfer at a time at full bandwidth, in send order.

A transfer is delivered `latency_s + jitter` after its last byte leaves; jitter is
exponential with mean `jitter_s` (0 = none), drawn per transfer from the line's own seeded
RNG. Small control messages (token ids, readiness acks) skip the byte queue and pay latency
and jitter only. `bytes_sent` counts bytes that really left (a cancelled transfer counts
what had been sent).

Streams: `open()` a transfer whose bytes are produced over time (P streams each prefill
step's KV) and `feed(tr, nbytes, last)` them; between feeds a stream that has sent everything
it was given leaves the sharing (fair), or each feed queues behind what is queued (FIFO); it
is delivered once its last byte (fed with last=True) has arrived.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable

import numpy as np

from pddjax.sim.events import EPS, EventLoop


class Transfer:
    __slots__ = ("nbytes", "on_done", "start_v", "end_v", "done", "cancelled", "sent", "t_start", "final", "active",
                 "left_before", "pieces")

    def __init__(self, nbytes: float, on_done: Callable[[], None], final: bool = True):
        self.nbytes, self.on_done = nbytes, on_done
        self.start_v = self.end_v = 0.0
        self.done = self.cancelled = False
        self.t_start = 0.0
        self.sent = 0.0  # bytes that left (nbytes once done)
        self.final = final  # all bytes fed (streams: False until the last feed)
        self.active = False  # sharing the bandwidth now (fair)
        self.left_before = 0.0  # stream: bytes that had left before the current active stretch
        self.pieces: list[Transfer] = []  # stream on a FIFO line: its feeds, queued in order


class Line:
    """A shared link from one datacenter to another (or an uncontended fast link)."""

    def __init__(self, loop: EventLoop, gbps: float, latency_s: float, jitter_s: float = 0.0,
                 sharing: str = "fair", seed: int = 0):
        if gbps <= 0 or latency_s < 0 or jitter_s < 0 or sharing not in ("fair", "fifo"):
            raise ValueError("line needs gbps > 0, latency >= 0, jitter >= 0, sharing fair|fifo")
        self.loop, self.bw = loop, gbps * 1e9 / 8  # bytes/s
        self.latency_s, self.jitter_s, self.sharing = latency_s, jitter_s, sharing
        self._rng = np.random.default_rng([seed, 7])
        self.bytes_sent = 0.0
        self._v, self._t = 0.0, 0.0  # virtual bytes served per flow, at time _t
        self._active: list[tuple[float, int, Transfer]] = []  # heap by end_v (fair)
        self._n = 0
        self._fifo: deque[Transfer] = deque()
        self._seq = itertools.count()
        self._version = 0

    # ---- queries ---------------------------------------------------------------------
    def delay(self) -> float:
        """One propagation delay sample: latency + jitter."""
        j = self._rng.exponential(self.jitter_s) if self.jitter_s > 0 else 0.0
        return self.latency_s + j

    def backlog_bytes(self) -> float:
        """Bytes still to leave for transfers in flight."""
        self._advance()
        if self.sharing == "fair":
            return sum(tr.end_v - self._v for tr in self._live())
        return sum(tr.nbytes for tr in self._fifo) - (self._fifo_sent() if self._fifo else 0.0)

    def predict_s(self, nbytes: float) -> float:
        """Predicted delivery time of a new `nbytes` transfer if nothing else arrives:
        fair: (b + sum_i min(r_i, b)) / bw over the remaining bytes r_i in flight;
        fifo: (backlog + b) / bw; plus mean latency and jitter."""
        self._advance()
        if self.sharing == "fair":
            ahead = sum(min(tr.end_v - self._v, nbytes) for tr in self._live())
        else:
            ahead = self.backlog_bytes()
        return (ahead + nbytes) / self.bw + self.latency_s + self.jitter_s

    # ---- mutations -------------------------------------------------------------------
    def message(self, on_done: Callable[[], None]) -> None:
        """A tiny control message: delivered after one propagation delay."""
        self.loop.after(self.delay(), on_done)

    def send(self, nbytes: float, on_done: Callable[[], None]) -> Transfer:
        """Start a transfer; on_done() runs when it is delivered (not if cancelled)."""
        tr = Transfer(float(nbytes), on_done)
        if nbytes <= 0:
            tr.done = True
            self.loop.after(self.delay(), on_done)
            return tr
        self._advance()
        tr.t_start = self.loop.now
        if self.sharing == "fair":
            self._activate(tr, tr.nbytes)
        else:
            self._fifo.append(tr)
            if len(self._fifo) == 1:
                tr.t_start = self.loop.now
        self._reschedule()
        return tr

    def cancel(self, tr: Transfer) -> None:
        """Stop a transfer in flight; the bytes already sent stay counted (in `tr.sent`)."""
        if tr.done or tr.cancelled:
            return
        if tr.pieces:  # a stream on a FIFO line
            tr.cancelled = True
            for piece in tr.pieces:
                self.cancel(piece)
            tr.sent = sum(piece.sent for piece in tr.pieces)
            return
        self._advance()
        tr.cancelled = True
        if self.sharing == "fair":
            if tr.active:
                tr.sent = tr.left_before + min(tr.end_v - tr.start_v, self._v - tr.start_v)
                tr.active = False
                self._n -= 1
            else:
                tr.sent = tr.left_before
        else:
            if self._fifo and self._fifo[0] is tr:
                tr.sent = self._fifo_sent()
                self._fifo.popleft()
                if self._fifo:
                    self._fifo[0].t_start = self.loop.now
            else:
                self._fifo.remove(tr)
        self.bytes_sent += tr.sent
        self._reschedule()

    def set_rate(self, gbps: float, latency_s: float, jitter_s: float) -> None:
        """Change the line's bandwidth and delays from now on (transfers in flight continue)."""
        if gbps <= 0 or latency_s < 0 or jitter_s < 0:
            raise ValueError("line needs gbps > 0, latency >= 0, jitter >= 0")
        self._advance()
        self.bw, self.latency_s, self.jitter_s = gbps * 1e9 / 8, latency_s, jitter_s
        self._reschedule()

    def open(self, on_done: Callable[[], None]) -> Transfer:
        """A stream: bytes arrive by `feed`; on_done() once the last fed byte is delivered."""
        tr = Transfer(0.0, on_done, final=False)
        tr.t_start = self.loop.now
        return tr

    def feed(self, tr: Transfer, nbytes: float, last: bool = False) -> None:
        """Give a stream `nbytes` more bytes to send; `last` marks its final piece."""
        if tr.final or tr.cancelled:
            raise ValueError("feeding a stream that is finished or cancelled")
        if self.sharing == "fifo":
            tr.nbytes += nbytes
            tr.final = last
            if last and nbytes <= 0 and tr.pieces and not tr.pieces[-1].done:
                tr.pieces[-1].on_done = lambda: self._stream_delivered(tr)  # arrives with the last bytes
                return
            tr.pieces.append(self.send(nbytes, (lambda: self._stream_delivered(tr)) if last else (lambda: None)))
            return
        self._advance()
        tr.nbytes += nbytes
        tr.final = last
        if tr.active:
            tr.end_v += nbytes
            heapq.heappush(self._active, (tr.end_v, next(self._seq), tr))  # the old entry goes stale
        elif nbytes > 0:
            self._activate(tr, nbytes)
        elif last:  # nothing left to send: delivered after one propagation delay
            self._deliver(tr)
            return
        self._reschedule()

    # ---- internals -------------------------------------------------------------------
    def _live(self):
        return [tr for tr in {id(t): t for _, _, t in self._active}.values() if tr.active]

    def _activate(self, tr: Transfer, nbytes: float) -> None:
        tr.left_before = tr.nbytes - nbytes
        tr.start_v, tr.end_v, tr.active = self._v, self._v + nbytes, True
        heapq.heappush(self._active, (tr.end_v, next(self._seq), tr))
        self._n += 1

    @staticmethod
    def _stream_delivered(tr: Transfer) -> None:
        if not tr.cancelled:
            tr.done, tr.sent = True, tr.nbytes
            tr.on_done()

    def _deliver(self, tr: Transfer) -> None:
        tr.done, tr.sent = True, tr.nbytes
        self.bytes_sent += tr.nbytes
        self.loop.after(self.delay(), tr.on_done)

    @staticmethod
    def _stale(entry) -> bool:
        key, _, tr = entry
        return tr.cancelled or not tr.active or key != tr.end_v

    def _fifo_sent(self) -> float:
        return min(self._fifo[0].nbytes, (self.loop.now - self._fifo[0].t_start) * self.bw)

    def _advance(self) -> None:
        now = self.loop.now
        if self.sharing == "fair" and self._n > 0:
            self._v += (now - self._t) * self.bw / self._n
        self._t = now

    def _reschedule(self) -> None:
        self._version += 1
        if self.sharing == "fair":
            while self._active and self._stale(self._active[0]):
                heapq.heappop(self._active)
            if not self._active:
                return
            dt = (self._active[0][0] - self._v) * self._n / self.bw
        else:
            if not self._fifo:
                return
            head = self._fifo[0]
            dt = head.t_start + head.nbytes / self.bw - self.loop.now
        self.loop.after(max(0.0, dt), self._complete, self._version)

    def _complete(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        finished = []
        if self.sharing == "fair":
            while self._active and (self._stale(self._active[0]) or self._active[0][0] <= self._v + EPS * self.bw):
                entry = heapq.heappop(self._active)
                if self._stale(entry):
                    continue
                tr = entry[2]
                tr.active = False
                self._n -= 1
                if tr.final:
                    finished.append(tr)
                else:  # a stream that sent all it has: waits for its next feed
                    tr.left_before = tr.nbytes
        else:
            tr = self._fifo.popleft()
            finished.append(tr)
            if self._fifo:
                self._fifo[0].t_start = self.loop.now
        for tr in finished:
            self._deliver(tr)
        if self.sharing == "fair" and self._n == 0:
            self._v = 0.0  # idle line: restart the virtual clock (keeps floats small)
            self._active.clear()
        self._reschedule()


def fast_link(loop: EventLoop, gbps: float = 400.0, latency_s: float = 10e-6) -> Line:
    """An intra-datacenter RDMA link (per sending instance, so no cross-instance contention)."""
    return Line(loop, gbps, latency_s, 0.0, "fair")

