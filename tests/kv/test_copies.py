"""The held KV gather / scatter (kv/copies.py): built ahead of time without running, a run of n
tokens padded to the smallest bucket already built for its pool's layout, the same tokens out
whatever the bucket, and no executable dropped by `jax.clear_caches()`."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from pddjax.kv import canonical, copies
from pddjax.kv.pool import KVPool


def filled_pool(num_pages: int) -> KVPool:
    """A pool [L=2, K=2, P, S=4, D=8] whose every slot holds a distinct value."""
    shape = (2, 2, num_pages, 4, 8)
    k = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    return KVPool(jax.numpy.asarray(k), jax.numpy.asarray(-k))


def test_a_run_pads_to_the_smallest_built_bucket_and_reads_the_same_tokens():
    held = copies.Copies()
    pool = filled_pool(37)  # a layout no other test uses: the process-wide copies stay out of it
    assert held.pad(pool, 5) == 16 and held.pad(pool, 100) == 128  # nothing built: the natural bucket
    held.build(copies.abstract(pool), 256)
    held.build(copies.abstract(pool), 32)
    assert held.buckets(pool) == [32, 256] and held.built == 2 and len(held) == 2
    assert held.pad(pool, 5) == 32 and held.pad(pool, 33) == 256 and held.pad(pool, 300) == 512
    held.check_integrity()
    pages = [3, 9, 1, 20]
    sp, so = canonical._slots(pages, 4, 1, 13, held.pad(pool, 13))  # tokens 1..13 of those pages
    assert len(sp) == 32
    jax.clear_caches()  # held executables survive it
    k, v = held.gather(pool, sp, so)  # [L, 32, K, D]
    want = np.asarray(pool.k)[:, :, np.asarray(pages)[np.arange(1, 14) // 4], np.arange(1, 14) % 4]  # [L, K, 13, D]
    np.testing.assert_array_equal(np.asarray(k)[:, :13], want.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(np.asarray(v)[:, :13], -want.transpose(0, 2, 1, 3))
    assert held.built == 2  # the call used what was built


def test_an_import_padded_past_its_bucket_writes_only_its_tokens():
    pool = filled_pool(41)
    fp = "f"
    run = canonical.export_run(pool, [2, 5, 7], 0, 10, fp)  # [L, 10, K, D]
    empty = np.zeros((2, 2, 47, 4, 8), np.float32)  # another layout: the export above built nothing for it
    target = KVPool(jax.numpy.asarray(empty), jax.numpy.asarray(empty))
    copies.copies().build(copies.abstract(target), 64)  # only a larger bucket than 10 needs
    assert copies.copies().pad(target, 10) == 64
    out = canonical.import_run(target, run, [11, 12, 13], fp)
    got = canonical.export_run(out, [11, 12, 13], 0, 10, fp)
    np.testing.assert_array_equal(got.k, run.k)
    written = np.asarray(out.k)
    assert not np.any(written[:, :, 1:11]) and not np.any(written[:, :, 14:])  # no other real page written


def test_the_broken_count_is_caught():
    held = copies.Copies()
    held.build(copies.abstract(filled_pool(43)), 16)
    held.built += 1
    with pytest.raises(AssertionError, match=re.escape("2 KV copy pairs built (0 behind), 1 held")):
        held.check_integrity()
    held.built -= 1
    held.check_integrity()
    held.built_behind = 2  # more built behind than built at all
    with pytest.raises(AssertionError, match=re.escape("1 KV copy pairs built (2 behind), 1 held")):
        held.check_integrity()
