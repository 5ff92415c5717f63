"""The canonical, layout-neutral form of a run of KV tokens: what crosses the wire between
heterogeneous accelerators.

A `KVRun` holds tokens [start, end) of one sequence as k, v [L, T, K, D] in a tagged dtype,
independent of the sender's page size and pool layout, plus the chained hashes of the full
pages it completes (so the receiver can index them in its prefix cache) and the model
fingerprint (KV from other weights is refused). `export_run` reads it out of a pool with any
page size; `import_run` writes it into a pool with another page size and dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pddjax.kv.allocator import NULL_PAGE
from pddjax.kv.pool import KVPool, read_tokens, write_tokens

DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}


class KVImportError(ValueError):
    """A run this pool cannot import (wrong model, layout or dtype); one sentence."""


@dataclasses.dataclass
class KVRun:
    fingerprint: str  # model weights the KV was computed with
    start: int  # first token position in the sequence
    k: np.ndarray  # [L, T, K, D]
    v: np.ndarray  # [L, T, K, D]
    dtype: str  # "float32" | "bfloat16" | "float16"
    page_hashes: list[int] = dataclasses.field(default_factory=list)  # chained hashes, optional

    @property
    def end(self) -> int:
        return self.start + self.k.shape[1]

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


def _bucket(n: int) -> int:
    b = 16
    while b < n:
        b *= 2
    return b


def _slots(pages: list[int], page_size: int, start: int, n: int, padded: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots of positions start..start+n in `pages`, padded to `padded` with page 0."""
    pos = np.arange(start, start + n)
    sp = np.full(padded, NULL_PAGE, np.int32)
    so = np.zeros(padded, np.int32)
    sp[:n] = np.asarray(pages, np.int32)[pos // page_size]
    so[:n] = pos % page_size
    return sp, so


@jax.jit
def _gather(pool: KVPool, slot_pages, slot_offsets):
    k, v = read_tokens(pool, slot_pages, slot_offsets)  # [L, K, T, D]
    return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [L, T, K, D]


@functools.partial(jax.jit, donate_argnames=("pool",))
def _scatter(pool: KVPool, k, v, slot_pages, slot_offsets):
    # k, v: [L, T, K, D] -> pool layout [L, K, T, D]
    return write_tokens(pool, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), slot_pages, slot_offsets)


def compiled_variants() -> int:
    """Distinct compiled shapes of the KV gather / scatter in this process."""
    return _gather._cache_size() + _scatter._cache_size()


def export_run(pool: KVPool, pages: list[int], start: int, end: int, fingerprint: str,
               page_hashes: list[int] | None = None) -> KVRun:
    """Tokens [start, end) of the sequence whose KV lives in `pages` (in token order)."""
    n = end - start
    sp, so = _slots(pages, pool.page_size, start, n, _bucket(n))
    k, v = _gather(pool, jnp.asarray(sp), jnp.asarray(so))
    k, v = np.asarray(k)[:, :n], np.asarray(v)[:, :n]
    name = jnp.dtype(pool.dtype).name
    return KVRun(fingerprint, start, k, v, name, list(page_hashes or []))


def check_importable(run: KVRun, pool: KVPool, fingerprint: str) -> None:
    """Raises KVImportError unless `run` fits this pool's model and layout."""
    if run.fingerprint != fingerprint:
        raise KVImportError(f"KV was computed by model {run.fingerprint}, this engine serves {fingerprint}")
    L, K, _, _, D = pool.k.shape
    if run.k.ndim != 4 or run.k.shape[0] != L or run.k.shape[2:] != (K, D) or run.v.shape != run.k.shape:
        raise KVImportError(f"KV layout {tuple(run.k.shape)} does not match [L={L}, T, K={K}, D={D}]")
    if run.dtype not in DTYPES:
        raise KVImportError(f"KV dtype {run.dtype!r} is not one of {sorted(DTYPES)}")


def import_run(pool: KVPool, run: KVRun, pages: list[int], fingerprint: str) -> KVPool:
    """Write `run` at its token positions into `pages` (this pool's page size and dtype;
    values are cast). The pool is donated: use the returned one."""
    check_importable(run, pool, fingerprint)
    n = run.num_tokens
    if run.end > len(pages) * pool.page_size:
        raise KVImportError(f"{len(pages)} pages of {pool.page_size} cannot hold tokens up to {run.end}")
    padded = _bucket(n)
    sp, so = _slots(pages, pool.page_size, run.start, n, padded)
    pad = ((0, 0), (0, padded - n), (0, 0), (0, 0))
    k = jnp.asarray(np.pad(run.k, pad), pool.dtype)
    v = jnp.asarray(np.pad(run.v, pad), pool.dtype)
    return _scatter(pool, k, v, jnp.asarray(sp), jnp.asarray(so))
