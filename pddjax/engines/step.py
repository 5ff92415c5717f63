"""The one jitted compute entry point of the paged engines: a packed ragged batch in, one
sampled token per row out, the KV pool donated and updated in place.

Static: model config, attention implementation, max row length bucket, greedy fast path.

Every distinct shape key (T, B, MP, Q buckets, flags) is its own XLA executable, a few MB of
host memory each, and a serving process under a varied load meets hundreds of keys over
hours. `run_step` therefore keeps at most `PDDJAX_STEP_EXECUTABLES` (default 128) compiled
variants, least recently used evicted first; an evicted key comes back from the persistent
compilation cache on disk (`jax_setup`), not from a fresh compile. Evicting an executable is
not enough to bound memory: JAX's own tracing and lowering caches keep every shape ever
lowered (~1-2 MB each here), so every `TRIM_EVERY` evictions `jax.clear_caches()` drops them
and `malloc_trim` hands the freed heap back (measured on the tiny model, 140 builds of
~60 distinct shapes at a cap of 8: RSS 440 -> 603 MB and rising without, flat ~290 with). `compile_count()` counts
variants built in this process (tests assert a steady workload adds none),
`resident_count()` those held now.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import threading

import jax

from pddjax.model.paged import PackedBatch, forward_paged
from pddjax.model.sampling import sample

DEFAULT_EXECUTABLES = 128
TRIM_EVERY = 8  # evictions between clearing JAX's internal caches


@functools.partial(jax.jit, static_argnames=("cfg", "max_q_len", "impl", "greedy", "return_logits"),
                   donate_argnames=("pool",))
def _step(w, batch: PackedBatch, pool, seeds, steps, temperature, top_k, top_p, *,
          cfg, max_q_len: int, impl: str, greedy: bool, return_logits: bool = False):
    # seeds, steps, top_k: [B] int32; temperature, top_p: [B] float32 -> tokens [B], pool
    logits, pool = forward_paged(w, cfg, batch, pool, max_q_len=max_q_len, impl=impl)  # [B, V]
    tokens = sample(logits, seeds, steps, temperature, top_k, top_p, greedy_only=greedy)
    return tokens, (logits if return_logits else None), pool


class Executables:
    """LRU of compiled `_step` variants keyed by static arguments and argument shapes,
    dtypes and shardings. Thread-safe (a service's engine thread and a test may share it)."""

    def __init__(self, capacity: int):
        self._lru: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.built = 0  # variants compiled (or loaded from the disk cache) in this process
        self.evicted = 0
        self.resize(capacity)

    def __call__(self, args: tuple, statics: dict):
        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple(sorted(statics.items())),
               tuple((x.shape, x.dtype, getattr(x, "sharding", None), getattr(x, "weak_type", False)) for x in leaves))
        with self._lock:
            fn = self._lru.get(key)
            if fn is not None:
                self._lru.move_to_end(key)
        if fn is None:
            fn = _step.lower(*args, **statics).compile()
            with self._lock:
                self.built += 1
                self._lru[key] = fn
                self._evict_to(self.capacity)
        return fn(*args)

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


def _release_jax_caches() -> None:
    """Drop JAX's per-shape tracing / lowering caches (held executables stay valid; other jitted
    functions re-lower on their next call, from the persistent cache) and trim the heap."""
    jax.clear_caches()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


_executables = Executables(int(os.environ.get("PDDJAX_STEP_EXECUTABLES", DEFAULT_EXECUTABLES)))


def run_step(w, cfg, batch: PackedBatch, pool, seeds, steps, temperature, top_k, top_p, *,
             max_q_len: int, impl: str, greedy: bool, return_logits: bool = False):
    """-> (tokens [B] int32, logits [B, V] or None, pool). `pool` is donated: use the one returned."""
    return _executables((w, batch, pool, seeds, steps, temperature, top_k, top_p),
                        {"cfg": cfg, "max_q_len": max_q_len, "impl": impl, "greedy": greedy,
                         "return_logits": return_logits})


def compile_count() -> int:
    """Variants of the step built in this process (evicted ones that came back count again)."""
    return _executables.built


def resident_count() -> int:
    """Variants held in memory now (<= PDDJAX_STEP_EXECUTABLES)."""
    return len(_executables)


def executables() -> Executables:
    return _executables
