"""Build what an engine's steps and KV copies will run, before it serves.

`precompile(engine, ready)` AOT-compiles (or loads from JAX's persistent compilation cache on
disk) members of the engine's stated step shape set (`buckets.bucket_set`, `engine.stated`)
and the KV gather / scatter per token bucket a sequence can need (kv/copies.py), so that from the
moment a service reports SERVING no request waits on a compile: `pddjax_jit_compiles_after_ready`
stays 0 (serving/engine/worker.py). The step executable LRU is raised to hold the whole set.

- ready "all": every member, then serve (the engine's shapes are the stated set).
- ready "cover": the covering set only (`buckets.covering_set`: a few members every step can
  be packed into; `kv_cover`: KV buckets 8x apart and the largest), then serve while
  `BackgroundBuild` compiles the rest in a thread at a lower CPU priority, the KV buckets first,
  then the members cheapest first (the small decode steps a light load runs), each member
  joining `engine.shapes` once built; a step always takes the best member already built, a KV
  copy the smallest bucket built that holds its run. A step that had to pad past its own member
  (not built yet) asks for it (`BackgroundBuild.want`), and what steps asked for is built next,
  before any other member or KV bucket: the shapes the first requests run arrive first (on the
  real model a covering member has the widest page table, and its decode step costs ~4x a
  narrow one's). The KV buckets follow at once (few, and a KV run pads to the smallest one
  built: P's push and MD's import of a 1.3K-token prompt padded to the largest were what made
  the demo's KV arrive after RLD had finished); members no step asked for then wait for an idle
  engine (`engine.busy()` false), so the first requests do not share the cores with them. With
  PDDJAX_BACKGROUND_BUILD=0 the rest is never built (the test suite's stacks, quick development
  runs): steps pad into the covering set.
A step is two programs (engines/step.py): a forward per member and a sampler per row count B.
Every B's sampler is built before the first members, so a member built later is its forward
alone. Each program is built under its lock (engines/build_locks.py): services that run the same
programs split the compiles between them and read each other's from the cache (the samplers
are shared by every engine of a model and mesh, whatever its pool).
A tensor-parallel engine builds the same set, each member its sharded executable
(`engine.layout`), and the KV copies on its sharded pool.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

import numpy as np

from pddjax import env
from pddjax.engines import buckets, startup_clock, step
from pddjax.engines.build_locks import SAMPLER_FIELDS, BuildLocks, build_in_turn
from pddjax.kv import copies
from pddjax.kv.allocator import NULL_PAGE
from pddjax.model.paged import PackedBatch
from pddjax.sizes import pow2_at_least

HEADROOM = 16  # LRU room beyond the set (test-only variants such as return_logits)
KV_MIN_BUCKET = copies.MIN_BUCKET  # a KV run's tokens pad to 16, 32, 64, ...
KV_COVER_STRIDE = 3  # under "cover", every third KV bucket (8x apart) is built before serving
READY = ("all", "cover")
BACKGROUND_NICE = 10  # the background builder's thread runs this much below the engine's
IDLE_POLL = 0.02  # seconds between the background builder's looks at a busy engine


def dummy_batch(shape: buckets.Shape, vocab_size: int | None = None) -> tuple[PackedBatch, tuple]:
    """An all-padding batch of `shape` (every slot page 0, the scratch page) and its sampling
    arrays, numpy with the dtypes `PagedEngine._build` / `_sampling_arrays` give: the very
    signature the serving loop calls the step with, so its calls hit what this builds. The token
    mask (int32 [B, ceil(V / 32)], all ones) is among them when `vocab_size` is given; without it
    the step adds the same all-ones mask itself (`step._arguments`): one signature either way."""
    T, B, MP, _ = shape
    z = np.zeros
    batch = PackedBatch(z(T, np.int32), z(T, np.int32), np.full(T, NULL_PAGE, np.int32), z(T, np.int32),
                        z(B + 1, np.int32), z(B, np.int32), z((B, MP), np.int32), z(B, np.int32))
    return batch, step.neutral_sampling(B, vocab_size)  # seeds, steps, temperature, top_k, top_p, pen_row .. mask


def kv_buckets(engine) -> list[int]:
    """Token counts the KV copies pad to, up to the longest sequence this engine can hold."""
    cfg = engine.config
    longest = min(engine.cfg.max_context, (cfg.num_pages - 1) * cfg.page_size)
    return buckets.ladder(KV_MIN_BUCKET, pow2_at_least(longest, KV_MIN_BUCKET), 2)


def kv_cover(kv: list[int]) -> list[int]:
    """The KV buckets built before serving under "cover": 16, 128, 1024, ... and the largest, so
    a run pads to at most 8x its bucket while the others build."""
    return sorted({*kv[::KV_COVER_STRIDE], kv[-1]})


def build_kv(pool, n: int, behind: bool = False) -> None:
    """Compile (or load) the KV gather and scatter for runs padded to n tokens in pools laid out
    as `pool` (a tree of jax.ShapeDtypeStruct, `copies.abstract`). `behind`: the background
    build's (counted apart from compiles on the request path)."""
    copies.copies().build(pool, n, behind)


def build_shape(engine, shape: buckets.Shape, behind: bool = False) -> int:
    """Compile (or load) the forward of one member, and the sampler of its row count if not held
    -> programs built now (0-2)."""
    batch, sampling = dummy_batch(shape)
    return step.build_step(engine.weights, engine.cfg, batch, engine.pool, sampling, max_q_len=shape[3],
                           impl=engine.config.attention, layout=engine.layout, behind=behind).built


def precompile(engine, ready: str = "all", clock=None) -> tuple[int, float]:
    """-> (programs built or loaded before serving: a forward per member, a sampler per B, two
    KV copies per bucket; seconds). Nothing runs: the pool is
    untouched. With ready "cover" the rest of the set is `engine.background` (a started
    BackgroundBuild). `clock` (a StartupClock) times the phases shapes_s and kv_copies_s."""
    if ready not in READY:
        raise ValueError(f"ready must be one of {', '.join(READY)}, got {ready!r}")
    t0 = time.perf_counter()
    execs = step.executables()
    samplers = sorted({s[1] for s in engine.stated})  # one per row count B
    execs.resize(max(execs.capacity, len(engine.stated) + len(samplers) + HEADROOM))
    first = engine.stated if ready == "all" else buckets.covering_set(engine.stated)
    with startup_clock.phase(clock, "shapes_s"):
        # every B's sampler first (a member built later is then its forward alone)
        build_in_turn([(b,) for b in samplers], BuildLocks.for_engine(engine, SAMPLER_FIELDS),
                      lambda rows: step.build_sampler(engine.cfg, rows[0], engine.layout))
        build_in_turn(first, BuildLocks.for_engine(engine), lambda shape: build_shape(engine, shape))
        engine.shapes = list(first)
        step.release_tracing_caches()  # held executables stay; JAX's per-shape lowering caches go
    pool, kv = copies.abstract(engine.pool), kv_buckets(engine)
    kv_first = kv if ready == "all" else kv_cover(kv)
    with startup_clock.phase(clock, "kv_copies_s"):
        for n in kv_first:
            build_kv(pool, n)
    rest, kv_rest = [s for s in engine.stated if s not in first], [n for n in kv if n not in kv_first]
    if (rest or kv_rest) and env.BACKGROUND_BUILD.get():
        engine.background = BackgroundBuild(engine, rest, kv=(pool, kv_rest))
    return len(first) + len(samplers) + 2 * len(kv_first), time.perf_counter() - t0


class _Stopped(Exception):
    """The background build was told to stop."""


class BackgroundBuild:
    """What a service did not wait for, built one by one in a daemon thread: the KV buckets
    (`kv`: (abstract pool, buckets), ascending), then the step members (`shapes`, in order: the
    set's own, cheapest first). Each member joins `engine.shapes` as a new sorted list (one
    assignment: the engine thread reads a whole list at each step); a KV bucket is used as soon
    as it is held (kv/copies.py). `built` counts members, `kv_built` KV buckets, `variants_built`
    of `variants_total` both as executables (the worker keeps them out of
    pddjax_jit_compiles_after_ready); `done` is set at the end, `error` holds what stopped it (one
    line on stderr; the engine keeps serving with what it has). `want(shape)` (from the engine's
    thread) puts a pending member ahead of every other build, first asked first built."""

    def __init__(self, engine, shapes: list[buckets.Shape], log=None, kv: tuple = (None, ())):
        self.engine, self.pending = engine, list(shapes)
        self.asked: list[buckets.Shape] = []  # members steps asked for, in order (each once)
        self._asked_set: set = set()
        self._wanted: collections.deque = collections.deque()  # asked, not yet moved ahead
        self.kv_pool, self.kv_pending = kv[0], list(kv[1])
        self.built = self.kv_built = 0
        self.seconds, self.error = 0.0, None
        self.done = threading.Event()
        self.on_progress = lambda: None  # after each build and at the end (a service refreshes its gauges)
        self._stopping = threading.Event()
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._thread = threading.Thread(target=self._run, name="background-build", daemon=True)
        self._thread.start()

    @property
    def variants_total(self) -> int:
        return len(self.pending) + 2 * len(self.kv_pending)

    @property
    def variants_built(self) -> int:
        return self.built + 2 * self.kv_built

    def want(self, shape: buckets.Shape) -> None:
        """A step padded past `shape` (its own member, not built yet): build it next. Cheap and
        thread-safe (a deque append); a shape asked before changes nothing."""
        if shape not in self._asked_set and not self.done.is_set():
            self._asked_set.add(shape)
            self.asked.append(shape)
            self._wanted.append(shape)

    def _wanted_first(self, todo: list) -> None:
        """Move the members newly asked for that are still in `todo` to its front, behind those
        asked before (already there): first asked, first built."""
        new = []
        while self._wanted:
            shape = self._wanted.popleft()
            if shape in todo:
                new.append(shape)
        if new:
            earlier = [s for s in todo if s in self._asked_set and s not in new]
            todo[:] = earlier + new + [s for s in todo if s not in self._asked_set]

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)  # this thread only (Linux)
        except (OSError, AttributeError):
            pass
        t0 = time.perf_counter()
        page_size = self.engine.config.page_size

        def joined(shape) -> None:
            self.engine.shapes = sorted([*self.engine.shapes, shape], key=lambda s: buckets.step_cost(s, page_size))
            self.built += 1
            self.on_progress()

        def build(shape) -> None:
            if self._stopping.is_set():
                raise _Stopped
            build_shape(self.engine, shape, behind=True)

        locks, members = BuildLocks.for_engine(self.engine), list(self.pending)

        def idle_or_asked() -> None:  # what no step asked for waits for an idle engine
            while self.engine.busy() and not self._wanted and not self._stopping.is_set():
                self._stopping.wait(IDLE_POLL)
            if self._stopping.is_set():
                raise _Stopped

        def reorder(todo: list) -> None:
            idle_or_asked()
            self._wanted_first(todo)

        def asked_now() -> None:  # members steps asked for go ahead of the KV buckets too
            while self._wanted:
                self._wanted_first(members)
                todo = [s for s in members if s in self._asked_set]
                build_in_turn(todo, locks, build, joined)
                members[:] = [s for s in members if s not in todo]

        try:
            for n in self.kv_pending:
                if self._stopping.is_set():
                    raise _Stopped
                asked_now()
                build_kv(self.kv_pool, n, behind=True)
                self.kv_built += 1
                self.on_progress()
            build_in_turn(members, locks, build, joined, reorder=reorder)
        except _Stopped:
            pass
        except Exception as e:  # noqa: BLE001 - a failed build leaves the engine on what it has
            self.error = f"{type(e).__name__}: {e}"
            self._log(f"pddjax: background build stopped after {self.variants_built} of {self.variants_total} "
                      f"executables: {self.error}")
        finally:
            self.seconds = time.perf_counter() - t0
            self.done.set()
            self.on_progress()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def stop(self, timeout: float = 60.0) -> bool:
        """Nothing after the build in flight; waits for that one (a process must not exit with
        a compile running in a thread: XLA aborts it) -> whether the thread ended in time."""
        self._stopping.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()
