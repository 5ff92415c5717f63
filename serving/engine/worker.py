"""One thread per engine: the only thread that ever calls the engine.

Services submit work as callables (`call(fn, *args)` runs fn(engine, *args) -> awaitable); between commands the
thread runs `engine.step()` while there is work, and hands each step's events to
`on_step(events)`, which runs in the worker thread too (so it may read the engine) and
passes results to asyncio with `post(fn, *args)` (loop.call_soon_threadsafe).

Urgent commands (`call(..., urgent=True)`: the handoff's token appends and RLD's pause) run
before every queued ordinary one, and while sequences have work the ordinary commands get at
most COMMAND_BUDGET_S between two steps, so a burst of other requests' KV imports never holds
a handoff's extend (or the decode rows) back by more than about one import.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
import traceback
from collections.abc import Callable

from pddjax.engines.engine_api import TokenEvent
from serving.engine.faults import StepFaults
from serving.engine.steplog import StepLog

COMMAND_BUDGET_S = 0.02  # ordinary commands between two steps while sequences have work
_URGENT, _ORDINARY, _STOP = 0, 1, 2  # queue priorities


class EngineWorker:
    def __init__(self, engine, loop: asyncio.AbstractEventLoop,
                 on_step: Callable[[list[TokenEvent]], None] | None = None, name: str = "engine"):
        self.engine, self.loop, self.on_step = engine, loop, on_step
        self._q: queue.PriorityQueue = queue.PriorityQueue()  # (priority, arrival, item)
        self._arrival = itertools.count()
        self._stop = False
        self._posted: list[tuple[Callable, tuple]] = []  # post()s not handed to the loop yet (engine thread)
        self._handed: list[tuple[Callable, tuple]] = []  # handed over, not run yet by the loop (under _hand_lock)
        self._hand_lock = threading.Lock()
        self.steps = 0
        self.faults = StepFaults(name)  # a step that raises fails its sequences, never retried
        self.metrics = None  # a ServiceMetrics: engine gauges are set from this thread (<= 4 per s, and when idle)
        self.compiles_at_ready: int | None = None  # compile count when the service went SERVING
        self.foreground_at_ready = 0  # of those, built on any thread but the background build's
        self._snapshot_at = 0.0
        self.log = StepLog.from_env(name)  # None unless PDDJAX_STEP_LOG is set
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable, *args, urgent: bool = False) -> asyncio.Future:
        """Run fn(engine, *args) on the engine thread; await the returned future for its result.
        `urgent`: before every ordinary command already queued (latency-critical, short). Event
        loop only. The result reaches the loop with fn's posts, in one hand-over (each wakes the
        loop's thread: ~30 us of the engine thread's CPU on this VM). Cancelled before it ran,
        fn never runs; cancelled while it runs, its result is dropped."""
        fut = self.loop.create_future()
        self._put(_URGENT if urgent else _ORDINARY, (fn, args, fut))
        return fut

    def run_soon(self, fn: Callable, *args, urgent: bool = False) -> None:
        """Run fn(engine, *args) on the engine thread and do not wait: for cleanup in `finally`
        blocks, where an awaited `call` could itself be cancelled and then skipped."""
        self._put(_URGENT if urgent else _ORDINARY, (fn, args, None))

    def _put(self, priority: int, item) -> None:
        self._q.put((priority, next(self._arrival), item))

    def post(self, fn: Callable, *args) -> None:
        """From the engine thread: run fn(*args) on the event loop. Posts are buffered and handed
        over together after each command and each step (one loop wake-up per step, not one per
        token of every stream), in order, and before the command's own result."""
        if threading.current_thread() is self._thread:
            self._posted.append((fn, args))
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def _flush(self) -> None:
        """Hands the posts over. The loop is woken only when it has no hand-over pending: while it
        is busy, later steps' posts join the pending one (each wake-up costs the engine thread a
        cross-CPU signal: ~30 us on this VM, more under load) and run with it, in order."""
        if not self._posted:
            return
        with self._hand_lock:
            pending = bool(self._handed)
            self._handed += self._posted
        self._posted = []
        if not pending:
            self.loop.call_soon_threadsafe(self._run_handed)

    def _run_handed(self) -> None:
        """Event loop: every post handed over so far, in order."""
        with self._hand_lock:
            batch, self._handed = self._handed, []
        _run_posted(self.loop, batch)

    def stop(self) -> None:
        self._stop = True
        self._put(_STOP, None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        if self.log is not None:
            self.log.engine_tid = threading.get_native_id()
        while not self._stop:
            try:
                item = self._q.get(block=not self.engine.has_work(), timeout=self.faults.tick())[2]
            except queue.Empty:
                item = False
            started = time.monotonic()
            while item is not False:
                if item is None:
                    if self.log is not None:
                        self.log.close()
                    return
                fn, args, fut = item
                with self._timed(getattr(fn, "__name__", "call")):
                    if fut is None:
                        try:
                            fn(self.engine, *args)
                        except Exception:  # noqa: BLE001  (cleanup must not kill the thread)
                            traceback.print_exc()
                    elif not fut.cancelled():  # (read across threads: a flag; a cancel after it drops the result)
                        try:
                            result = fn(self.engine, *args)
                        except BaseException as e:  # noqa: BLE001  (handed to the awaiting coroutine)
                            self._posted.append((fail, (fut, e)))
                        else:
                            self._posted.append((resolve, (fut, result)))  # after what fn posted
                    self._flush()
                item = self._next_command(started)
            if self.engine.has_work():
                try:
                    with self._timed("step", lambda: getattr(self.engine, "last_shape", ())):
                        events = self.engine.step()
                    self.steps += 1
                    if self.on_step is not None:
                        with self._timed("on_step"):
                            self.on_step(events)
                except Exception as exc:  # noqa: BLE001  (its sequences fail; the engine serves on)
                    self.faults.failed(self.engine, exc)
                self._flush()  # the step's tokens, to every stream, in one hand-over
            now = time.monotonic()
            if self.metrics is not None and (now - self._snapshot_at >= 0.25 or not self.engine.has_work()):
                self._snapshot_at = now  # num_pages_active walks every sequence: not on every step
                with self._timed("snapshot"):
                    self.metrics.engine_snapshot(self.snapshot())

    def _next_command(self, started: float):
        """The next queued command, or False: none queued, or only ordinary ones while the
        engine has work and this round's ordinary budget is spent (the step goes first)."""
        try:
            priority, _, item = self._q.get_nowait()
        except queue.Empty:
            return False
        if priority == _ORDINARY and time.monotonic() - started > COMMAND_BUDGET_S and self.engine.has_work():
            self._q.put((priority, _, item))  # keeps its place: same priority, same arrival number
            return False
        return item

    def _timed(self, name: str, shape=None):
        """The step log's timer for a block on this thread (nothing without a log)."""
        return self.log.timed(name, shape) if self.log is not None else contextlib.nullcontext()

    @staticmethod
    def compiles() -> int:
        """Jitted step / KV copy variants built in this process so far."""
        from pddjax.engines.step import compile_count  # the engine's process has jax loaded
        from pddjax.kv.canonical import compiled_variants

        return compile_count() + compiled_variants()

    def mark_ready(self) -> None:
        """The service reports SERVING now: compiles after this are counted apart."""
        self.foreground_at_ready = self.foreground_compiles()
        self.compiles_at_ready = self.compiles()

    @staticmethod
    def foreground_compiles() -> int:
        """Of `compiles()`, those not built by a background build: after SERVING, the request
        path's (each counter read under its own lock, so a build in flight is never half counted)."""
        from pddjax.engines.step import compile_count_foreground
        from pddjax.kv.canonical import compiled_variants_foreground

        return compile_count_foreground() + compiled_variants_foreground()

    def snapshot(self) -> dict:
        """Engine occupancy, read on the engine thread."""
        from pddjax.engines.step import resident_count
        from pddjax.kv.canonical import compiled_variants

        e = self.engine
        compiles = self.compiles()
        background = getattr(e, "background", None)  # precompile.BackgroundBuild: members built while serving
        built_behind = background.variants_built if background is not None else 0
        after_ready = 0 if self.compiles_at_ready is None else self.foreground_compiles() - self.foreground_at_ready
        alloc = getattr(e, "allocator", None)
        return {"pages_active": getattr(e, "num_pages_active", 0), "pages_used": alloc.num_used if alloc else 0,
                "pages_total": alloc.capacity if alloc else 0, "sequences": len(e.seqs), "steps": self.steps,
                "queue_depth": self._q.qsize(), "compiles": compiles,
                "compiles_after_ready": after_ready, "background_compiles": built_behind,
                "background_pending": (background.variants_total - built_behind) if background is not None else 0,
                "faults": self.faults.total, "spec_drafted": getattr(e, "spec_drafted", 0),
                "spec_accepted": getattr(e, "spec_accepted", 0),
                "executables": resident_count() + compiled_variants()}


def _run_posted(loop: asyncio.AbstractEventLoop, batch: list) -> None:
    """Event loop: the engine thread's posts, in order; one that raises does not skip the rest."""
    for fn, args in batch:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            loop.call_exception_handler({"message": f"engine post {fn!r} failed", "exception": e})


def resolve(fut: asyncio.Future, value) -> None:
    """Event-loop thread: set a future's result unless it is already done."""
    if not fut.done():
        fut.set_result(value)


def fail(fut: asyncio.Future, exc: BaseException) -> None:
    """Event-loop thread: set a future's exception unless it is already done."""
    if not fut.done():
        fut.set_exception(exc)
