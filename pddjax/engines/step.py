"""The one jitted compute entry point of the paged engines: a packed ragged batch in, one
sampled token per row out, the KV pool donated and updated in place.

Static: model config, attention implementation, max row length Q, return_logits (tests).
Greedy is an argument, not a static: `lax.cond` runs argmax or the sampler, so greedy and
sampled steps share one executable per shape. So are penalties, logit bias and logprobs
(`sampling.sample_step`): per-row arrays of shape [B] and the engine's penalty tables
(`penalties.Tables`, [ROWS, V], donated like the pool: the step counts each sampled token in
its row), each part skipped by `lax.cond` when no row of the step uses it. So is the token mask
of constrained decoding (int32 [B, ceil(V / 32)], `model/token_mask.py`; all ones for an
unconstrained row, and the whole masking skipped when every row is all ones). They add no member
to the shape set and no key: every step of an engine passes them, of the same shapes (a caller
that leaves the mask out gets a shared all-ones one of the same shape and dtype).

Every distinct shape key (T, B, MP, Q) is its own XLA executable, a few MB of host memory
each. An engine runs only the shapes of its stated set (`buckets.bucket_set`) and builds them
all before it serves (`PagedEngine.precompile` -> `build`). `run_step` keeps at most
`PDDJAX_STEP_EXECUTABLES` (default 128, raised by `precompile` to hold its set) compiled
variants, least recently used evicted first; an evicted key comes back from the persistent
compilation cache on disk (`jax_setup`), not from a fresh compile. Evicting an executable is
not enough to bound memory: JAX's own tracing and lowering caches keep every shape ever
lowered (~1-2 MB each here), so every `TRIM_EVERY` evictions `jax.clear_caches()` drops them
(and every jitted function's cache: the KV copies reload from disk on next use)
and `malloc_trim` hands the freed heap back (measured on the tiny model, 140 builds of
~60 distinct shapes at a cap of 8: RSS 440 -> 603 MB and rising without, flat ~290 with). `compile_count()` counts
variants built in this process (tests assert a steady workload adds none),
`resident_count()` those held now.

Tensor parallel (`layout`, an `engines.mesh.EngineMesh` of degree > 1): the same `_step`,
jitted with explicit in / out shardings (weights by their logical axes, the pool by KV heads
or replicated, batch and sampling arrays replicated; tokens, logits and the pool out the same
way, the pool donated) and the mesh as a static, so the logits are gathered (replicated)
before sampling and every device draws the same token. At degree 1 nothing changes.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import threading
import weakref
from typing import NamedTuple

import jax
import numpy as np

from pddjax import env
from pddjax.engines import exec_cache, penalty_state
from pddjax.kv.pool import KVPool
from pddjax.model import token_mask
from pddjax.model.paged import PackedBatch, forward_paged
from pddjax.model.penalties import Tables
from pddjax.model.sampling import sample_step

TRIM_EVERY = 8  # evictions between clearing JAX's internal caches


STATICS = ("cfg", "max_q_len", "impl", "return_logits")
NUM_SAMPLING = 11  # per-step sampling arrays (`sampling.sample_step`): ten [B], the token mask [B, W]


class StepOut(NamedTuple):
    tokens: jax.Array  # [B] int32
    logprobs: tuple  # (chosen [B] f32, top ids [B, 20] i32, top logprobs [B, 20] f32); zeros unless a row asked
    logits: jax.Array | None  # [B, V] float32 (return_logits only)
    pool: KVPool
    tables: Tables | None  # the penalty tables, sampled tokens counted (None: none passed)


def _step(w, batch: PackedBatch, pool, tables, seeds, steps, temperature, top_k, top_p, pen_row, presence,
          frequency, repetition, want_logprobs, mask, greedy, *, cfg, max_q_len: int, impl: str,
          return_logits: bool = False, mesh=None, kv_sharded: bool = True):
    # seeds, steps, top_k, pen_row: [B] int32; temperature, top_p, presence, frequency,
    # repetition: [B] float32; want_logprobs: [B] bool; mask: [B, ceil(V / 32)] int32;
    # greedy: [] bool; tables: Tables or None
    logits, pool = forward_paged(w, cfg, batch, pool, max_q_len=max_q_len, impl=impl, mesh=mesh,
                                 kv_sharded=kv_sharded)  # [B, V]
    if mesh is not None:  # sampling on replicated logits: every device draws the same token
        from jax.sharding import NamedSharding, PartitionSpec

        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, PartitionSpec()))
    sp = (seeds, steps, temperature, top_k, top_p, pen_row, presence, frequency, repetition, want_logprobs, mask)
    tokens, lp, tables = sample_step(logits, tables, sp, greedy)  # [B]
    return StepOut(tokens, lp, logits if return_logits else None, pool, tables)


_single = jax.jit(_step, static_argnames=STATICS, donate_argnames=("pool", "tables"))


@functools.lru_cache(maxsize=64)
def _sharded(layout, w_tree, statics: tuple):
    """`_step` jitted for one mesh layout, weights tree and statics, shardings stated in and out
    (jit takes no keyword arguments with in_shardings: the statics are bound first)."""
    rep, pool = layout.replicated, layout.pool_sharding
    w_shardings = layout.weight_shardings(jax.tree_util.tree_unflatten(w_tree, [0] * w_tree.num_leaves))
    kw = dict(statics)
    return jax.jit(functools.partial(_step, **kw), donate_argnums=(2, 3),
                   in_shardings=(w_shardings, rep, pool, rep, *[rep] * NUM_SAMPLING, rep),
                   out_shardings=StepOut(rep, rep, rep if kw["return_logits"] else None, pool, rep))


class _Bound:
    """A sharded step for `Executables.build`: `.lower(*args, **statics)` like `_single`'s."""

    def __init__(self, layout, args):
        self.layout, self.w_tree = layout, jax.tree_util.tree_structure(args[0])

    def lower(self, *args, **statics):
        return _sharded(self.layout, self.w_tree, tuple(sorted(statics.items()))).lower(*args)


def _jitted(args: tuple, statics: dict, layout):
    if layout is None or layout.mesh is None:
        return _single
    return _Bound(layout, args)


class Executables:
    """LRU of compiled `_step` variants keyed by static arguments and argument shapes,
    dtypes and shardings. Thread-safe (a service's engine thread and a test may share it)."""

    def __init__(self, capacity: int):
        self._lru: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.built = 0  # variants compiled (or loaded from the disk cache) in this process
        self.built_behind = 0  # of those, by a background build (`build(..., behind=True)`)
        self.evicted = 0
        self._weights: dict[int, tuple] = {}  # id(weights) -> (weak reference, signature)
        self.resize(capacity)

    def __call__(self, args: tuple, statics: dict, layout=None):
        return self.build(args, statics, layout)(*args)

    def build(self, args: tuple, statics: dict, layout=None, behind: bool = False):
        """The executable for these arguments' shapes and statics: held, or compiled now (from
        the persistent cache on disk when it has it). Nothing runs. `behind`: a background
        build's compile (counted apart in `built_behind`)."""
        key = (self._weights_signature(args[0]), _signature(args[1:]), tuple(sorted(statics.items())))
        with self._lock:
            fn = self._lru.get(key)
            if fn is not None:
                self._lru.move_to_end(key)
        if fn is None:
            fn = _load_or_compile(args, statics, layout, key)
            with self._lock:
                self.built += 1
                self.built_behind += behind
                self._lru[key] = fn
                self._evict_to(self.capacity)
        return fn

    def counts(self) -> tuple[int, int]:
        """(built, built_behind), read together."""
        with self._lock:
            return self.built, self.built_behind

    def _weights_signature(self, w):
        """`_signature(w)`, computed once per weights object (an engine's weights never change;
        flattening them on every step cost ~15 us on the tiny model): held by id beside a weak
        reference, so a recycled id is never mistaken for the object it once named."""
        with self._lock:
            held = self._weights.get(id(w))
            if held is not None and held[0]() is w:
                return held[1]
        sig = _signature(w)
        try:
            ref = weakref.ref(w)
        except TypeError:  # a tree that takes no weak reference (a plain dict): not held
            return sig
        with self._lock:
            self._weights = {k: v for k, v in self._weights.items() if v[0]() is not None}
            self._weights[id(w)] = (ref, sig)
        return sig

    def resize(self, capacity: int) -> None:
        """Change the cap; evicts the least recently used down to it at once."""
        if capacity < 1:
            raise ValueError(f"the step executable cache needs room for at least 1 variant, not {capacity}")
        with self._lock:
            self.capacity = capacity
            self._evict_to(capacity)

    def _evict_to(self, capacity: int) -> None:
        """Drop the least recently used variants down to `capacity` (lock held); every
        TRIM_EVERY evictions also JAX's per-shape caches."""
        while len(self._lru) > capacity:
            self._lru.popitem(last=False)
            self.evicted += 1
            if self.evicted % TRIM_EVERY == 0:
                _release_jax_caches()

    def __len__(self) -> int:
        return len(self._lru)

    def check_integrity(self) -> None:
        if len(self._lru) > self.capacity:
            raise AssertionError(f"{len(self._lru)} step executables held, capacity {self.capacity}")
        if self.built - self.evicted != len(self._lru):
            raise AssertionError(f"built {self.built} - evicted {self.evicted} != held {len(self._lru)}")


def _load_or_compile(args: tuple, statics: dict, layout, key: tuple):
    """A single-device variant from the executable cache on disk (no tracing, no lowering), else
    traced, lowered, compiled afresh and stored there (exec_cache.py says why afresh); a sharded
    one traced, lowered and compiled with XLA's compile found in JAX's persistent cache when it
    holds it."""
    if (layout is None or layout.mesh is None) and exec_cache.enabled():
        name = exec_cache.key(key[:2], statics)
        fn = exec_cache.load(name, _devices(args))
        if fn is None:
            with exec_cache.fresh_compile():
                fn = _jitted(args, statics, layout).lower(*args, **statics).compile()
            exec_cache.store(name, fn)
        return fn
    return _jitted(args, statics, layout).lower(*args, **statics).compile()


def _devices(args: tuple) -> list:
    """The devices of the step's placed arguments (one, at one device), by id; else the default one."""
    found = {d for x in jax.tree_util.tree_leaves(args) if hasattr(x, "sharding") for d in x.sharding.device_set}
    return sorted(found, key=lambda d: d.id) or jax.devices()[:1]


def _signature(tree) -> tuple:
    """Structure, and every leaf's shape, dtype, sharding (None: numpy) and weak type."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None), getattr(x, "weak_type", False))
                          for x in leaves)


def _release_jax_caches() -> None:
    """Drop JAX's per-shape tracing / lowering caches (held executables stay valid; other jitted
    functions re-lower on their next call, from the persistent cache) and trim the heap."""
    jax.clear_caches()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


_executables = Executables(env.STEP_EXECUTABLES.get())  # read once: the cache is process-wide


def neutral_sampling(B: int, vocab_size: int | None = None) -> tuple:
    """The per-step sampling arrays of B greedy rows that use nothing else, numpy, in the dtypes
    the serving loop passes (`step_batch.sampling_arrays`, `precompile.dummy_batch`): the ten [B]
    arrays, then the all-ones token mask [B, ceil(vocab_size / 32)] when `vocab_size` is given
    (else the step adds it: `_arguments`)."""
    z = np.zeros
    out = (z(B, np.int32), z(B, np.int32), z(B, np.float32), z(B, np.int32), np.ones(B, np.float32),
           np.full(B, -1, np.int32), z(B, np.float32), z(B, np.float32), np.ones(B, np.float32), z(B, bool))
    return out if vocab_size is None else (*out, token_mask.all_allowed(B, vocab_size))


@functools.lru_cache(maxsize=32)
def _no_mask(B: int, vocab_size: int) -> np.ndarray:
    """The all-ones mask a step without constrained rows passes, one read-only array per shape
    (never written, so a step may read it while the next is built)."""
    mask = token_mask.all_allowed(B, vocab_size)
    mask.flags.writeable = False
    return mask


def _arguments(w, cfg, batch, pool, tables, sampling, greedy, max_q_len, impl, return_logits, layout):
    # batch and sampling arrays are numpy (host): the compiled step's C++ dispatch transfers
    # them; `precompile` builds with numpy too, so the executable key below matches. A caller
    # of the first five arrays only (seeds .. top_p) gets the rest neutral; one of the ten [B]
    # arrays, the shared all-ones mask.
    sampling = tuple(sampling)
    if len(sampling) < NUM_SAMPLING - 1:
        sampling += neutral_sampling(len(sampling[0]))[len(sampling):]
    if len(sampling) < NUM_SAMPLING:
        sampling += (_no_mask(len(sampling[0]), cfg.vocab_size),)
    host = (*sampling, np.asarray(bool(greedy)))
    statics = {"cfg": cfg, "max_q_len": max_q_len, "impl": impl, "return_logits": return_logits}
    if layout is not None and layout.mesh is not None:
        statics.update(mesh=layout.mesh, kv_sharded=layout.kv_sharded)
        batch, host = layout.put_replicated(batch), layout.put_replicated(host)
    return (w, batch, pool, tables, *host), statics


def run(w, cfg, batch: PackedBatch, pool, sampling: tuple, tables: Tables | None, *, max_q_len: int, impl: str,
        greedy: bool, return_logits: bool = False, layout=None) -> StepOut:
    """One step: forward + sample. `pool` and `tables` are donated: use the ones returned.
    `sampling`: the NUM_SAMPLING arrays of `sampling.sample_step`; `tables`: the engine's
    penalty tables (None: no penalties, what a multi-host instance runs). `layout`: the engine's
    `EngineMesh` (None or degree 1: one device)."""
    args, statics = _arguments(w, cfg, batch, pool, tables, sampling, greedy, max_q_len, impl, return_logits, layout)
    return _executables(args, statics, layout)


def run_step(w, cfg, batch: PackedBatch, pool, *sampling, max_q_len: int, impl: str, greedy: bool,
             return_logits: bool = False, layout=None):
    """`run` without penalty tables -> (tokens [B] int32, logits [B, V] or None, pool): the step a
    multi-host instance's processes run (engines/multihost.py replays it)."""
    out = run(w, cfg, batch, pool, sampling, None, max_q_len=max_q_len, impl=impl, greedy=greedy,
              return_logits=return_logits, layout=layout)
    return out.tokens, out.logits, out.pool


def serving_tables(cfg, layout=None) -> Tables | None:
    """Penalty tables as a PagedEngine of this model and layout holds them (zeros), or None on a
    multi-host instance (penalties off there: engines/penalty_state.py)."""
    if jax.process_count() > 1:
        return None
    tables = Tables.zeros(penalty_state.ROWS, cfg.vocab_size)
    return tables if layout is None or layout.mesh is None else layout.put_replicated(tables)


@functools.lru_cache(maxsize=4)
def _built_tables(cfg, layout) -> Tables | None:
    """Zero tables to build steps with (never donated: nothing runs), one per model and layout."""
    return serving_tables(cfg, layout)


def build_step(w, cfg, batch: PackedBatch, pool, sampling: tuple, *, max_q_len: int, impl: str, layout=None,
               behind: bool = False):
    """Compile (or load) the serving variant of these shapes without running it -> the executable
    (a `jax.stages.Compiled`: `.as_text()` is its HLO). The penalty tables are the engine's
    shape and placement (`serving_tables`). `behind`: counted as a background build's."""
    args, statics = _arguments(w, cfg, batch, pool, _built_tables(cfg, layout), sampling, False, max_q_len, impl,
                               False, layout)
    return _executables.build(args, statics, layout, behind)


def release_tracing_caches() -> None:
    """After building many variants: drop JAX's per-shape lowering caches (held executables stay)."""
    _release_jax_caches()


def compile_count() -> int:
    """Variants of the step built in this process (evicted ones that came back count again),
    and of the penalty tables' seed program."""
    return _executables.built + penalty_state.seed_builds()


def compile_count_foreground() -> int:
    """Of `compile_count()`, the variants compiled on any thread but a background build's."""
    built, behind = _executables.counts()
    return built - behind + penalty_state.seed_builds()


def resident_count() -> int:
    """Variants held in memory now (<= PDDJAX_STEP_EXECUTABLES)."""
    return len(_executables)


def executables() -> Executables:
    return _executables
