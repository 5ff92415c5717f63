"""The canonical, layout-neutral form of a run of KV tokens: what crosses the wire between
heterogeneous accelerators.

A `KVRun` holds tokens [start, end) of one sequence as k, v [L, T, K, D] in a tagged dtype,
independent of the sender's page size and pool layout, plus the chained hashes of the full
pages it completes (so the receiver can index them in its prefix cache) and the model
fingerprint (KV from other weights is refused). `export_run` reads it out of a pool with any
page size; `import_run` writes it into a pool with another page size and dtype.

Tensor parallelism: a pool sharded over its KV heads (k, v [L, K, P, S, D] split on K over a
mesh axis) exports one piece per distinct head range (`export_shards`: each device gathers its
own heads, the host reads each shard on its own; a replicated pool gives one piece of all
heads), a `KVRun` whose `head_start` names its first head (k, v [L, T, Kr, D], heads
[head_start, head_end)). `import_run` takes one run or the head pieces of one token range and
places each device's heads from whichever pieces hold them (`jax.make_array_from_callback`
with the pool's head sharding): nothing is gathered on one device unless the pool is on one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from pddjax.kv.allocator import NULL_PAGE
from pddjax.kv.copies import copies, run_sharding
from pddjax.kv.pool import KVPool

DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}


class KVImportError(ValueError):
    """A run this pool cannot import (wrong model, layout or dtype); one sentence."""


@dataclasses.dataclass
class KVRun:
    fingerprint: str  # model weights the KV was computed with
    start: int  # first token position in the sequence
    k: np.ndarray  # [L, T, Kr, D]: KV heads [head_start, head_start + Kr) (Kr = K for a whole run)
    v: np.ndarray  # [L, T, Kr, D]
    dtype: str  # "float32" | "bfloat16" | "float16"
    page_hashes: list[int] = dataclasses.field(default_factory=list)  # chained hashes, optional
    head_start: int = 0  # first KV head this piece holds

    @property
    def end(self) -> int:
        return self.start + self.k.shape[1]

    @property
    def head_end(self) -> int:
        return self.head_start + self.k.shape[2]

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


Pieces = KVRun | list[KVRun]  # one run, or the head pieces of one token range


def as_pieces(run: Pieces) -> list[KVRun]:
    """The head pieces of `run`, by first head."""
    return sorted([run] if isinstance(run, KVRun) else run, key=lambda r: r.head_start)


def head_problem(run: Pieces, num_kv_heads: int) -> str | None:
    """One sentence if the pieces do not hold KV heads [0, num_kv_heads) exactly once over one
    token range (a head missing, a head twice, ranges of different tokens), else None."""
    pieces = as_pieces(run)
    first = pieces[0]
    at = 0
    for r in pieces:
        if (r.start, r.num_tokens) != (first.start, first.num_tokens):
            return (f"KV heads [{r.head_start}, {r.head_end}) cover tokens [{r.start}, {r.end}), the others "
                    f"[{first.start}, {first.end})")
        if r.head_start > at:
            return f"KV heads [{at}, {r.head_start}) of tokens [{first.start}, {first.end}) are missing"
        if r.head_start < at:
            return (f"KV heads [{r.head_start}, {min(at, r.head_end)}) of tokens [{first.start}, {first.end}) "
                    f"arrive twice")
        at = r.head_end
    if at != num_kv_heads:
        return f"KV heads [{at}, {num_kv_heads}) of tokens [{first.start}, {first.end}) are missing"
    return None


def span(run: Pieces) -> tuple[int, int]:
    """Token range [start, end) of a run or of its head pieces."""
    r = as_pieces(run)[0]
    return r.start, r.end


def from_token(run: Pieces, pos: int) -> Pieces:
    """The same KV from token `pos` on (start <= pos <= end), head pieces kept apart."""
    def cut(r: KVRun) -> KVRun:
        skip = pos - r.start
        return dataclasses.replace(r, start=pos, k=r.k[:, skip:], v=r.v[:, skip:])
    return cut(run) if isinstance(run, KVRun) else [cut(r) for r in run]


def join_heads(run: Pieces) -> KVRun:
    """One whole run from head pieces (a host concatenation; a whole run is returned as is)."""
    pieces = as_pieces(run)
    if len(pieces) == 1:
        return pieces[0]
    k = np.concatenate([r.k for r in pieces], axis=2)  # [L, T, K, D]
    v = np.concatenate([r.v for r in pieces], axis=2)
    return dataclasses.replace(pieces[0], k=k, v=v, head_start=0)


def degree(pool: KVPool) -> int:
    """Devices the pool lives on (its engine's tensor-parallel degree)."""
    return len(pool.k.sharding.device_set)


def head_ranges(pool: KVPool) -> list[tuple[int, int]]:
    """Distinct KV head ranges the pool's devices hold (one (0, K) when on one device or replicated)."""
    K = pool.k.shape[1]
    return sorted({s.index[1].indices(K)[:2] for s in pool.k.addressable_shards})


def _slots(pages: list[int], page_size: int, start: int, n: int, padded: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots of positions start..start+n in `pages`, padded to `padded` with page 0."""
    pos = np.arange(start, start + n)
    sp = np.full(padded, NULL_PAGE, np.int32)
    so = np.zeros(padded, np.int32)
    sp[:n] = np.asarray(pages, np.int32)[pos // page_size]
    so[:n] = pos % page_size
    return sp, so


def compiled_variants() -> int:
    """KV gather / scatter executables built in this process (two per padded bucket)."""
    return 2 * copies().built


def compiled_variants_foreground() -> int:
    """Of `compiled_variants()`, those built on any thread but a background build's."""
    built, behind = copies().counts()
    return 2 * (built - behind)


def _heads(index: tuple, num_kv_heads: int) -> tuple[int, int]:
    """KV head range of a shard of a [L, T, K, D] array, from its index (slices)."""
    h0, h1, _ = index[2].indices(num_kv_heads)
    return h0, h1


def export_shards(pool: KVPool, pages: list[int], start: int, end: int, fingerprint: str,
                  page_hashes: list[int] | None = None) -> list[KVRun]:
    """Tokens [start, end) of the sequence whose KV lives in `pages` (in token order), one piece
    per distinct head range of the pool's shards (by first head; replicas read once). Each
    device gathers its own heads; each shard is read to the host on its own."""
    n = end - start
    sp, so = _slots(pages, pool.page_size, start, n, copies().pad(pool, n))
    k, v = copies().gather(pool, sp, so)  # [L, Tpad, K, D], sharded as the pool
    K, name = k.shape[2], jnp.dtype(pool.dtype).name
    if not k.is_fully_addressable:  # a pool across processes (engines/multihost.py): every process runs this
        from jax.experimental import multihost_utils

        k, v = multihost_utils.process_allgather((k, v), tiled=True)  # host [L, Tpad, K, D], all heads
        return [KVRun(fingerprint, start, k[:, :n], v[:, :n], name, list(page_hashes or []), 0)]
    vs = {_heads(s.index, K): s for s in v.addressable_shards}
    pieces: dict[tuple[int, int], KVRun] = {}
    for s in k.addressable_shards:
        heads = _heads(s.index, K)
        if heads not in pieces:  # a replica of a range already read is skipped
            pieces[heads] = KVRun(fingerprint, start, np.asarray(s.data)[:, :n], np.asarray(vs[heads].data)[:, :n],
                                  name, list(page_hashes or []), heads[0])
    return [pieces[h] for h in sorted(pieces)]


def export_run(pool: KVPool, pages: list[int], start: int, end: int, fingerprint: str,
               page_hashes: list[int] | None = None) -> KVRun:
    """Tokens [start, end) as one whole run (the shards' heads joined on the host)."""
    return join_heads(export_shards(pool, pages, start, end, fingerprint, page_hashes))


def check_importable(run: Pieces, pool: KVPool, fingerprint: str) -> None:
    """Raises KVImportError unless `run` (or its head pieces) fits this pool's model and layout."""
    L, K, _, _, D = pool.k.shape
    for r in as_pieces(run):
        if r.fingerprint != fingerprint:
            raise KVImportError(f"KV was computed by model {r.fingerprint}, this engine serves {fingerprint}")
        if (r.k.ndim != 4 or r.k.shape[0] != L or r.k.shape[3] != D or r.v.shape != r.k.shape
                or not 0 <= r.head_start < r.head_end <= K):
            raise KVImportError(f"KV layout {tuple(r.k.shape)} from head {r.head_start} does not match "
                                f"[L={L}, T, K={K}, D={D}]")
        if r.dtype not in DTYPES:
            raise KVImportError(f"KV dtype {r.dtype!r} is not one of {sorted(DTYPES)}")
    problem = head_problem(run, K)
    if problem:
        raise KVImportError(problem)


def _place(pieces: list[KVRun], which: str, pool: KVPool, padded: int) -> np.ndarray | jax.Array:
    """k or v [L, padded, K, D] in the pool's dtype: on one device the host array, else a device array
    whose devices each hold their heads from the pieces."""
    L, K, _, _, D = pool.k.shape
    dtype, n = np.dtype(pool.dtype), pieces[0].num_tokens
    made: dict[tuple[int, int], np.ndarray] = {}

    def heads_of(index) -> np.ndarray:  # [L, padded, h1 - h0, D]
        h0, h1 = _heads(index, K)
        if (h0, h1) not in made:  # replicas share one host array
            out = np.zeros((L, padded, h1 - h0, D), dtype)
            for r in pieces:
                lo, hi = max(h0, r.head_start), min(h1, r.head_end)
                if lo < hi:
                    out[:, :n, lo - h0:hi - h0] = getattr(r, which)[:, :, lo - r.head_start:hi - r.head_start]
            made[(h0, h1)] = out
        return made[(h0, h1)]
    if not isinstance(pool.k.sharding, NamedSharding):  # one device: the host array itself, which the
        # precompiled scatter takes as it takes the slots (uncommitted, as the pool is); not
        # jax.device_put (its Python path cost more than the copy) nor jnp.asarray (a conversion
        # primitive dispatched per call)
        return heads_of((slice(None),) * 4)
    return jax.make_array_from_callback((L, padded, K, D), run_sharding(pool), heads_of)


def import_run(pool: KVPool, run: Pieces, pages: list[int], fingerprint: str) -> KVPool:
    """Write `run` (or the head pieces of one token range) at its token positions into `pages`
    (this pool's page size and dtype; values are cast on the host). Each device receives only the
    heads it holds. The pool is donated: use the returned one."""
    check_importable(run, pool, fingerprint)
    pieces = as_pieces(run)
    start, end = span(pieces)
    n = end - start
    if end > len(pages) * pool.page_size:
        raise KVImportError(f"{len(pages)} pages of {pool.page_size} cannot hold tokens up to {end}")
    padded = copies().pad(pool, n)
    sp, so = _slots(pages, pool.page_size, start, n, padded)
    k, v = _place(pieces, "k", pool, padded), _place(pieces, "v", pool, padded)
    return copies().scatter(pool, k, v, sp, so)
