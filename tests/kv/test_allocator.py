"""PageAllocator and SequencePages: refcounts, the reserved page 0, and page-table rows."""

import numpy as np
import pytest

from pddjax.kv.allocator import OutOfPages, PageAllocator
from pddjax.kv.page_table import SequencePages, pages_needed


def test_page_zero_is_never_handed_out():
    a = PageAllocator(5)
    assert a.num_free == 4 and a.num_used == 0
    assert a.allocate(4) == [1, 2, 3, 4]
    assert a.refcount(0) == 0
    assert not a.can_allocate(1)
    a.check_integrity()


def test_allocate_lowest_first_and_reuses_freed_pages():
    a = PageAllocator(8)
    assert a.allocate(3) == [1, 2, 3]
    assert a.decref([2]) == [2]
    assert a.allocate(2) == [2, 4]
    a.check_integrity()


def test_out_of_pages_allocates_nothing():
    a = PageAllocator(4)
    a.allocate(2)
    with pytest.raises(OutOfPages, match="requested 2 KV pages but only 1"):
        a.allocate(2)
    assert a.num_free == 1 and a.num_used == 2
    a.check_integrity()


def test_refcounts_free_only_at_zero():
    a = PageAllocator(4)
    (p,) = a.allocate(1)
    a.incref([p])
    assert a.refcount(p) == 2
    assert a.decref([p]) == []
    assert a.decref([p]) == [p]
    assert a.refcount(p) == 0 and a.num_free == 3
    a.check_integrity()


def test_decref_of_free_page_raises_and_changes_nothing():
    a = PageAllocator(4)
    p, q = a.allocate(2)
    with pytest.raises(ValueError):
        a.decref([p, 3])  # 3 is free
    assert a.refcount(p) == 1
    with pytest.raises(ValueError):
        a.decref([q, q])  # refcount 1, dropped twice
    assert a.refcount(q) == 1
    with pytest.raises(ValueError):
        a.incref([3])
    with pytest.raises(ValueError):
        a.decref([0])
    a.check_integrity()


def test_can_allocate_matches_allocate():
    a = PageAllocator(6)
    for n in range(7):
        assert a.can_allocate(n) == (n <= 5)


def test_pages_needed():
    assert [pages_needed(t, 4) for t in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_sequence_pages_slots_and_table_row():
    s = SequencePages(page_size=4, pages=[7, 3, 9], num_tokens=10, num_cached=4)
    s.check_integrity()
    assert s.extra_pages_needed(12) == 0 and s.extra_pages_needed(13) == 1
    assert s.slot_of(0) == (7, 0)
    assert s.slot_of(5) == (3, 1)
    assert s.slot_of(11) == (9, 3)
    slots = s.slots([0, 5, 11])
    assert slots.dtype == np.int32 and slots.shape == (3, 2)
    np.testing.assert_array_equal(slots, [[7, 0], [3, 1], [9, 3]])
    assert s.slots([]).shape == (0, 2)
    row = s.table_row(5)
    assert row.dtype == np.int32
    np.testing.assert_array_equal(row, [7, 3, 9, 0, 0])
    with pytest.raises(IndexError):
        s.slot_of(12)
    with pytest.raises(ValueError):
        s.table_row(2)


def test_sequence_pages_integrity_catches_bad_counts():
    with pytest.raises(AssertionError):
        SequencePages(page_size=4, pages=[1], num_tokens=5).check_integrity()
    with pytest.raises(AssertionError):
        SequencePages(page_size=4, pages=[1, 1], num_tokens=5).check_integrity()
    with pytest.raises(AssertionError):
        SequencePages(page_size=4, pages=[1, 2], num_tokens=5, num_cached=3).check_integrity()
