"""A decode instance (RLD, MD or plain D) with continuous batching and extend-decode passes.

Life of a sequence here: `enqueue` (waiting for KV memory and a batch slot) -> admitted at a
step boundary (its KV reserved in the instance's pool, evicting cached DRC entries LRU) ->
either decoding at once (`auto_start`) or idle until the handoff protocol calls
`start_decoding` after its extend chunks -> finished when its remaining tokens reach zero.

Time advances in *segments*: runs of identical steps between state changes. A plain segment
of n decode steps (n = fewest remaining tokens in the batch) costs n * step_s(B, contexts)
and ends in one event; any change (admission, extend chunk, removal) cuts the segment at the
next step boundary, where the batch is re-planned. Extend chunks either ride in the next
decode step (`batch_extend=True`: one mixed pass) or run as passes of their own, one per
chunk, while the decode batch waits (`batch_extend=False`: the tail chunks that cannot be
batched). Progress is O(1) per event: each running sequence stores the instance step count
at which it joined, so emitted = base + (steps - joined).

On a shared host (`host` given, `bench serve` validation) every step is its own segment and a
job on the `Host` (timed by `engine_steps.StepModel` with the rows' contexts), and commands
(`run_command`: KV imports) run on the engine thread between steps, before the next one, as
pddjax's engine worker does.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable

from pddjax.sim.cache import PrefixCache
from pddjax.sim.engine_steps import StepModel
from pddjax.sim.events import EPS, EventLoop, SimError
from pddjax.sim.host import step_class

_ids = itertools.count()


class Seq:
    """One request's presence on one decode instance."""

    __slots__ = ("req", "need", "state", "auto_start", "join", "base_emitted", "base_ctx",
                 "finish_at", "reserved", "on_admit", "on_finish", "id", "emitted_final")

    def __init__(self, req, need: int, ctx: int, remaining: int, auto_start: bool,
                 on_admit: Callable[[Seq], None], on_finish: Callable[[Seq], None]):
        self.req, self.need, self.auto_start = req, int(need), auto_start
        self.base_ctx, self.base_emitted, self.join = ctx, 1, 0
        self.finish_at = remaining  # relative until started
        self.state = "new"  # new -> waiting -> admitted -> running -> done
        self.reserved = 0
        self.on_admit, self.on_finish = on_admit, on_finish
        self.id = next(_ids)
        self.emitted_final = 0


class DecodeInstance:
    """Continuous-batching decoder on one instance; see the module docstring."""

    def __init__(self, loop: EventLoop, name: str, perf, cache: PrefixCache, max_batch: int,
                 batch_extend: bool = True, host=None, step_cores: float = 1.0):
        self.loop, self.name, self.perf, self.cache = loop, name, perf, cache
        self.host, self.step_cores = host, step_cores
        self.steps_model = StepModel(perf) if host is not None else None
        self._commands: deque[tuple[float, Callable[[], None]]] = deque()
        self.max_batch, self.batch_extend = max(1, max_batch), batch_extend
        self.waiting: deque[Seq] = deque()
        self.admitted = 0  # admitted but not running (handoff targets)
        self._run: dict[int, Seq] = {}
        self._heap: list[tuple[int, int, Seq]] = []  # (finish step, id, seq)
        self._ext: deque[tuple[Seq, int, int, Callable[[], None]]] = deque()  # (seq, k, ctx, done)
        self._pending: list[tuple[Seq, int, int, int]] = []  # (seq, emitted, remaining, ctx) to start
        self.steps = 0  # decode steps taken by this instance's running batch
        self._ctx_off = 0  # sum(base_ctx - join) over running: ctx_sum = off + B * steps
        self._busy, self._planning, self._version = False, False, 0
        self._t0 = self._dt = 0.0
        self._n, self._kind, self._seg_ext = 0, "idle", []
        self.busy_time = 0.0
        self.tokens_out = 0
        self.extend_passes = 0
        self.committed = 0  # pool tokens reserved for requests whose KV is on its way (router's view)

    # ---- queries ---------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return len(self._run)

    def load(self) -> int:
        """Sequences here in any state (running, admitted, waiting)."""
        return len(self._run) + self.admitted + len(self.waiting)

    def step_estimate(self, extra_ctx: int = 0) -> float:
        """Seconds per decode step if one more sequence of `extra_ctx` joined now."""
        b = self.batch + 1
        return self.perf.step_s(b, self._ctx_off + self.batch * self.steps + extra_ctx)

    def _done_in_segment(self) -> int:
        if not self._busy or self._kind in ("extend", "command") or self._dt <= 0 or self.host is not None:
            return 0
        return min(self._n, int(math.floor((self.loop.now - self._t0) / self._dt + EPS)))

    def progress(self, seq: Seq) -> int:
        """Tokens `seq` has emitted by now (1 = the prefill's token). Does not modify state."""
        if seq.state != "running":
            return seq.emitted_final or seq.base_emitted
        return seq.base_emitted + self.steps - seq.join + self._done_in_segment()

    # ---- mutations -------------------------------------------------------------------
    def enqueue(self, seq: Seq) -> None:
        """Queue a sequence for admission (needs `seq.need` KV tokens)."""
        seq.state = "waiting"
        self.waiting.append(seq)
        self._kick()

    def run_command(self, work_s: float, fn: Callable[[], None]) -> None:
        """Engine-thread work between steps (a KV import): fn() when done. Free without a host."""
        if self.host is None:
            fn()
            return
        self._commands.append((work_s, fn))
        self._kick()

    def extend(self, seq: Seq, k: int, ctx: int, on_done: Callable[[], None]) -> None:
        """Run an extend-decode pass of k tokens at context ctx for an admitted sequence."""
        self._ext.append((seq, k, ctx, on_done))
        self._kick()

    def start_decoding(self, seq: Seq, emitted: int, remaining: int, ctx: int) -> None:
        """An admitted sequence begins decoding (at the next step boundary) with `emitted`
        tokens already out and `remaining` still to emit."""
        if seq.state != "admitted":
            raise SimError(f"start_decoding on a {seq.state} sequence")
        seq.base_emitted = emitted
        self._pending.append((seq, emitted, remaining, ctx))
        self._kick()

    def remove(self, seq: Seq) -> int:
        """Take a sequence out now (handoff release, abort); frees its KV; returns tokens emitted."""
        emitted = self.progress(seq)
        if seq.state == "running":
            self._sync()
            emitted = seq.base_emitted + self.steps - seq.join
            del self._run[seq.id]
            self._ctx_off -= seq.base_ctx - seq.join
            self._kick()
        elif seq.state == "waiting":
            self.waiting.remove(seq)
        elif seq.state == "admitted":
            self.admitted -= 1
            self._pending = [p for p in self._pending if p[0] is not seq]
        self._free(seq)
        seq.state, seq.emitted_final = "done", emitted
        return emitted

    # ---- internals -------------------------------------------------------------------
    def _free(self, seq: Seq) -> None:
        if seq.reserved:
            self.cache.release(seq.reserved)
            seq.reserved = 0

    def _add_running(self, seq: Seq, emitted: int, remaining: int, ctx: int) -> None:
        seq.state, seq.join, seq.base_emitted, seq.base_ctx = "running", self.steps, emitted, ctx
        seq.finish_at = self.steps + remaining
        self._run[seq.id] = seq
        self._ctx_off += ctx - self.steps
        heapq.heappush(self._heap, (seq.finish_at, seq.id, seq))

    def _sync(self) -> None:
        """Apply the whole steps completed so far in the current segment."""
        k = self._done_in_segment()
        if k:
            self.steps += k
            self.tokens_out += k * len(self._run)
            self._t0 += k * self._dt
            self._n -= k

    def _kick(self) -> None:
        if self._planning:
            return
        if not self._busy:
            self._boundary()
            return
        self._sync()
        if self._kind == "idle":
            return
        if self._n > 1:  # cut the segment at the next step boundary
            self.busy_time -= (self._n - 1) * self._dt
            self._n = 1
            self._version += 1
            self.loop.at(self._t0 + self._dt, self._segment_end, self._version)

    def _segment_end(self, version: int) -> None:
        if version != self._version:
            return
        if self._kind == "command":
            self._busy, self._n, self._kind = False, 0, "idle"
            self._planning = True
            fns, self._seg_ext = self._seg_ext, []
            for fn in fns:
                fn()
            self._planning = False
            self._boundary()
            return
        if self._kind in ("decode", "mixed"):
            self.steps += self._n
            self.tokens_out += self._n * len(self._run)
        self._busy, self._n = False, 0
        self._planning = True
        for *_, done in self._seg_ext:
            done()
        self._seg_ext = []
        self._planning = False
        self._boundary()

    def _finish_due(self) -> None:
        while self._heap and (self._heap[0][2].state != "running" or self._heap[0][0] <= self.steps):
            _, _, seq = heapq.heappop(self._heap)
            if seq.state != "running":
                continue
            del self._run[seq.id]
            self._ctx_off -= seq.base_ctx - seq.join
            self._free(seq)
            seq.state, seq.emitted_final = "done", seq.base_emitted + self.steps - seq.join
            seq.on_finish(seq)

    def _boundary(self) -> None:
        """At a step boundary (nothing in flight): commands, then finish, start, admit, plan."""
        if self._commands:
            work = sum(w for w, _ in self._commands)
            self._seg_ext = [f for _, f in self._commands]
            self._commands.clear()
            self._kind, self._busy, self._n, self._t0, self._dt = "command", True, 1, self.loop.now, work
            self._version += 1
            self.host.run(work, 1.0, lambda v=self._version: self._segment_end(v), self.name)
            return
        self._planning = True
        for seq, emitted, remaining, ctx in self._pending:
            self.admitted -= 1
            self._add_running(seq, emitted, remaining, ctx)
        self._pending = []
        self._finish_due()
        while self.waiting and len(self._run) + self.admitted < self.max_batch:
            seq = self.waiting[0]
            if not self.cache.reserve(seq.need):
                break
            self.waiting.popleft()
            seq.reserved += seq.need
            seq.state = "admitted"
            if seq.auto_start:
                self._add_running(seq, 1, seq.finish_at, seq.base_ctx)
            else:
                self.admitted += 1
            seq.on_admit(seq)
        self._finish_due()
        self._planning = False
        if self._pending:  # started by an admission callback: join right away
            self._boundary()
            return
        self._plan(self.loop.now)

    def _plan(self, now: float) -> None:
        b = len(self._run)
        ctx_sum = self._ctx_off + b * self.steps
        if self._ext:
            if self.batch_extend:
                items = list(self._ext)
                self._ext.clear()
            else:
                items = [self._ext.popleft()]
            k = sum(i[1] for i in items)
            ectx = sum(i[2] for i in items)
            pairs = sum(i[1] * i[2] + i[1] * i[1] / 2 for i in items)
            if self.host is not None:
                self._kind = "mixed" if self.batch_extend else "extend"
                dt = self.steps_model.step_s(b if self.batch_extend else 0, self._max_ctx() + 1,
                                             [(i[1], i[2] + i[1]) for i in items])
            elif self.batch_extend:
                self._kind, dt = "mixed", self.perf.step_s(b, ctx_sum, k, ectx, pairs)
            else:
                self._kind, dt = "extend", self.perf.step_s(0, 0, k, ectx, pairs)
            self.extend_passes += 1
            self._seg_ext, n = items, 1
        elif b:
            n = self._heap_min() - self.steps
            if n <= 0:
                raise SimError(f"{self.name}: running sequence with no tokens left")
            self._kind = "decode"
            if self.host is not None:
                n, dt = 1, self.steps_model.step_s(b, self._max_ctx() + 1)
            else:
                dt = self.perf.step_s(b, ctx_sum + b * (n - 1) / 2)
        else:
            self._kind = "idle"
            return
        self._busy, self._t0, self._dt, self._n = True, now, dt, n
        self.busy_time += n * dt
        self._version += 1
        if self.host is not None:
            ext = sum(i[1] for i in self._seg_ext) if self._kind in ("mixed", "extend") else 0
            rows = b if self._kind in ("decode", "mixed") else 0
            kind = step_class(ext + rows, rows + (len(self._seg_ext) if ext else 0), decode_only=not ext)
            self.host.run(dt, self.step_cores, lambda v=self._version: self._segment_end(v), self.name, kind)
        else:
            self.loop.at(now + n * dt, self._segment_end, self._version)

    def _max_ctx(self) -> int:
        """Longest context among the running sequences (0 if none)."""
        return max((s.base_ctx + self.steps - s.join for s in self._run.values()), default=0)

    def _heap_min(self) -> int:
        while self._heap[0][2].state != "running":
            heapq.heappop(self._heap)
        return self._heap[0][0]

    def check_integrity(self) -> None:
        """Raise SimError on inconsistent accounting."""
        self.cache.check_integrity()
        held = sum(s.reserved for s in self._run.values())
        if held > self.cache.reserved:
            raise SimError(f"{self.name}: running sequences hold more than reserved")
        if len(self._run) + self.admitted > self.max_batch:
            raise SimError(f"{self.name}: batch over max_batch")
