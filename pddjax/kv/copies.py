"""The compiled KV gather and scatter that move a run of tokens out of and into a pool, one pair
of executables per (pool layout, padded token count).

A run of n tokens is padded to a bucket (16, 32, 64, ... tokens) so a few programs serve every
length. The executables are built ahead of time (`build`: lowered and compiled, or loaded from
JAX's persistent compilation cache, without running) and held here, so a later
`jax.clear_caches()` does not drop them and a background thread can build them while the
engine's thread uses the ones it has. `pad(pool, n)` picks the smallest bucket already built
for this layout that holds n tokens (a larger one than n needs while the rest are still being
built: the extra slots read and write page 0, the scratch page); with none built, the natural
bucket, compiled on first use. Thread-safe.
"""

from __future__ import annotations

import functools
import threading

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pddjax.kv.pool import KVPool, read_tokens, write_tokens
from pddjax.sizes import pow2_at_least

MIN_BUCKET = 16  # the smallest padded run


def _gather(pool: KVPool, slot_pages, slot_offsets):
    # slot_pages, slot_offsets: [T] int32 -> k, v [L, T, K, D]; each device gathers its own heads
    k, v = read_tokens(pool, slot_pages, slot_offsets)  # [L, K, T, D]
    return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _scatter(pool: KVPool, k, v, slot_pages, slot_offsets):
    # k, v: [L, T, K, D] (sharded on K as the pool is) -> the pool with those slots written
    return write_tokens(pool, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), slot_pages, slot_offsets)


_gather_jit = jax.jit(_gather)
_scatter_jit = jax.jit(_scatter, donate_argnames=("pool",))


def run_sharding(pool: KVPool) -> NamedSharding | None:
    """Sharding of a [L, T, K, D] run placed as the pool [L, K, P, S, D] holds its heads (None on
    one device: the run is an uncommitted array, as the pool is)."""
    s = pool.k.sharding
    if not isinstance(s, NamedSharding):
        return None
    spec = (*s.spec, None, None)
    return NamedSharding(s.mesh, PartitionSpec(None, None, spec[1], None))


def _layout(pool: KVPool) -> tuple:
    return pool.k.shape, str(pool.k.dtype), pool.k.sharding if isinstance(pool.k.sharding, NamedSharding) else None


class Copies:
    """Held gather / scatter executables by (pool layout, padded tokens)."""

    def __init__(self):
        self._held: dict[tuple, tuple] = {}  # (layout, padded) -> (gather, scatter) executables
        self._lock = threading.Lock()
        self.built = 0  # pairs compiled or loaded in this process
        self.built_behind = 0  # of those, by a background build (`build(..., behind=True)`)

    def pad(self, pool: KVPool, n: int) -> int:
        """Tokens to pad a run of n to: the natural bucket if built (or nothing is built for
        this layout), else the smallest larger bucket that is."""
        natural = pow2_at_least(n, MIN_BUCKET)
        layout = _layout(pool)
        with self._lock:
            built = sorted(p for lay, p in self._held if lay == layout)
        if not built or natural in built:
            return natural
        return next((p for p in built if p >= natural), natural)

    def buckets(self, pool: KVPool) -> list[int]:
        """Buckets built for this pool's layout, ascending."""
        layout = _layout(pool)
        with self._lock:
            return sorted(p for lay, p in self._held if lay == layout)

    def build(self, pool: KVPool, padded: int, behind: bool = False) -> tuple:
        """The (gather, scatter) pair for `padded` tokens in pools laid out as `pool`: held, or
        compiled now (nothing runs; `pool` may be a tree of jax.ShapeDtypeStruct). `behind`: a
        background build's compile (counted apart in `built_behind`)."""
        key = (_layout(pool), padded)
        with self._lock:
            pair = self._held.get(key)
        if pair is not None:
            return pair
        L, K, _, _, D = pool.k.shape
        slots = jax.ShapeDtypeStruct((padded,), np.int32)
        run = jax.ShapeDtypeStruct((L, padded, K, D), pool.k.dtype, sharding=run_sharding(pool))
        gather = _gather_jit.lower(pool, slots, slots).compile()
        scatter = _scatter_jit.lower(pool, run, run, slots, slots).compile()
        with self._lock:
            if key not in self._held:
                self._held[key] = (gather, scatter)
                self.built += 1
                self.built_behind += behind
            return self._held[key]

    def gather(self, pool: KVPool, slot_pages: np.ndarray, slot_offsets: np.ndarray):
        """k, v [L, T, K, D] of the slots (T = len(slot_pages), a built or buildable bucket)."""
        return self.build(pool, len(slot_pages))[0](pool, slot_pages, slot_offsets)

    def scatter(self, pool: KVPool, k, v, slot_pages: np.ndarray, slot_offsets: np.ndarray) -> KVPool:
        """The pool (donated) with k, v [L, T, K, D] written at the slots."""
        return self.build(pool, len(slot_pages))[1](pool, k, v, slot_pages, slot_offsets)

    def counts(self) -> tuple[int, int]:
        """(built, built_behind), read together."""
        with self._lock:
            return self.built, self.built_behind

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def check_integrity(self) -> None:
        with self._lock:
            if self.built != len(self._held) or not 0 <= self.built_behind <= self.built:
                raise AssertionError(f"{self.built} KV copy pairs built ({self.built_behind} behind), "
                                     f"{len(self._held)} held")
            for (_, padded), pair in self._held.items():
                if padded < MIN_BUCKET or padded & (padded - 1) or len(pair) != 2:
                    raise AssertionError(f"KV copy bucket {padded} is not a power of two >= {MIN_BUCKET}")


@functools.cache
def copies() -> Copies:
    """The process's held KV copies (one per process: every engine in it shares the executables)."""
    return Copies()


def abstract(pool: KVPool) -> KVPool:
    """A pool of jax.ShapeDtypeStruct with the pool's shapes, dtypes and shardings (for building
    from another thread while the engine's thread donates the real arrays)."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), pool)
