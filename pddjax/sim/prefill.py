"""A prefill (P) instance: FIFO, one prompt at a time, with its own prefix cache.

Prefill is compute-bound, so batching several prompts buys little throughput; we run jobs
back to back. At job start the instance looks up its cache (the session's latest prompt, or
the shared doc), computes only the missing tokens, and afterwards caches this prompt as the
session's entry. P never sees output tokens, so its entry is the prompt only: the next
turn's prefix beyond it (the previous output) is recomputed here even on a "full" hit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pddjax.sim.cache import PrefixCache
from pddjax.sim.events import EventLoop
from pddjax.sim.lineage import Lineage


class PrefillInstance:
    """One P instance; `submit` a request, `on_done(req)` fires when its KV is ready."""

    def __init__(self, loop: EventLoop, name: str, perf, lineage: Lineage, on_done: Callable):
        self.loop, self.name, self.perf, self.lineage = loop, name, perf, lineage
        self.cache = PrefixCache(perf.kv_capacity_tokens)
        self.on_done = on_done
        self.queue: deque = deque()
        self._busy_until = 0.0
        self._queued_s = 0.0  # predicted seconds of queued (not started) work
        self.busy_time = 0.0
        self.tokens_computed = 0

    # ---- queries ---------------------------------------------------------------------
    def hit_for(self, req) -> int:
        """Prompt tokens this instance would reuse for `req` now (no cache change)."""
        return min(self.lineage.cached_hit(self.cache, req), req.prompt - 1)

    @staticmethod
    def run_command(work: float, fn) -> None:
        """RPCs cost nothing here (no engine thread is modelled)."""
        fn()

    def _hit(self, req) -> int:
        return self.hit_for(req) if req.hit_forced is None else req.hit_forced

    def predict_s(self, req) -> float:
        """Predicted seconds from now until `req` would finish here."""
        hit = self.hit_for(req)
        wait = max(0.0, self._busy_until - self.loop.now) + self._queued_s
        return wait + self.perf.prefill_s(req.prompt - hit, hit)

    # ---- mutations -------------------------------------------------------------------
    def submit(self, req, export_from: int = 0, hit: int | None = None) -> None:
        """Queue `req` (this P computes the whole prompt, then hands over all of its KV;
        `export_from` is not needed here); `hit` overrides the cache lookup."""
        req.hit_forced = hit
        hit = self._hit(req)
        req.p_predicted_s = self.perf.prefill_s(req.prompt - hit, hit)
        self._queued_s += req.p_predicted_s
        self.queue.append(req)
        if self._busy_until <= self.loop.now and len(self.queue) == 1:
            self._start()

    def _start(self) -> None:
        req = self.queue.popleft()
        self._queued_s = max(0.0, self._queued_s - req.p_predicted_s)
        now = self.loop.now
        hit = self._hit(req)
        key = ("s", req.sid)
        entry = self.cache.take(key)  # pin the session prefix while we extend it
        pinned = entry.tokens if entry else 0
        self.cache.touch(("d", req.doc))
        working = max(0, req.prompt - pinned)
        ok = self.cache.reserve(working)
        dt = self.perf.prefill_s(req.prompt - hit, hit)
        req.prefill_start, req.p_hit, req.p_inst = now, hit, self
        self.tokens_computed += req.prompt - hit
        self.busy_time += dt
        self._busy_until = now + dt
        self.loop.after(dt, self._finish, req, pinned + (working if ok else 0))

    def _finish(self, req, held: int) -> None:
        self.cache.release(held)
        self.cache.insert(("s", req.sid), req.prompt, req.turn)
        if req.turn == 0:
            old = self.cache.get(("d", req.doc))
            if old is None or old.tokens < req.prefix:
                self.cache.insert(("d", req.doc), req.prefix, -1)
        req.prefill_end = self.loop.now
        if self.queue:
            self._start()
        self.on_done(req)

    def check_integrity(self) -> None:
        self.cache.check_integrity()
