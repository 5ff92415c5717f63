"""Reference-counted allocator of KV-cache page ids (host side, no jax).

Contract: `PageAllocator(num_pages)` hands out page ids 1..num_pages-1, lowest id first.
Page 0 is the scratch/null page: engines pad page tables with 0 and write padded tokens
there, so it is never allocated, never freed and never counted as free or used.

Every holder of a page owns one reference: `allocate` gives the caller one, `incref` adds
one per extra holder (e.g. the prefix cache), and `decref` returns the pages whose count
reached zero, which go back to the free pool.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

NULL_PAGE = 0  # reserved scratch page; padding target in page tables


class OutOfPages(Exception):
    """Raised by `allocate` when fewer pages are free than requested (nothing allocated)."""


class PageAllocator:
    """Refcounted pool of page ids 1..num_pages-1; page 0 is reserved."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages  # total ids, including the reserved page 0
        self._refcount: dict[int, int] = {}  # used page id -> refcount >= 1
        self._free: list[int] = list(range(1, num_pages))  # min-heap of free ids
        self._free_set: set[int] = set(self._free)

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages that `allocate` can hand out now."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages with refcount >= 1 (page 0 excluded)."""
        return len(self._refcount)

    @property
    def capacity(self) -> int:
        """Allocatable pages: num_pages - 1."""
        return self.num_pages - 1

    def can_allocate(self, n: int) -> bool:
        """True if `allocate(n)` would succeed. Does not modify the allocator."""
        return 0 <= n <= len(self._free)

    def refcount(self, page: int) -> int:
        """Current reference count of `page` (0 if free). Page 0 always reports 0."""
        if page == NULL_PAGE:
            return 0
        self._check_id(page)
        return self._refcount.get(page, 0)

    # ---- mutations -----------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages, lowest ids first, each with refcount 1.

        Raises OutOfPages (allocating nothing) if fewer than `n` are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise OutOfPages(
                f"requested {n} KV pages but only {len(self._free)} of "
                f"{self.capacity} are free"
            )
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._free_set.discard(p)
            self._refcount[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each page; every page must already be in use."""
        pages = list(pages)
        for p in pages:
            self._check_id(p)
            if p not in self._refcount:
                raise ValueError(f"incref of page {p}, which is not allocated")
        for p in pages:
            self._refcount[p] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference from each page; return the pages that became free.

        A page may appear several times (one reference dropped per occurrence).
        Raises ValueError (changing nothing) if any page would go below zero.
        """
        pages = list(pages)
        drops: dict[int, int] = {}
        for p in pages:
            self._check_id(p)
            drops[p] = drops.get(p, 0) + 1
        for p, d in drops.items():
            if self._refcount.get(p, 0) < d:
                raise ValueError(
                    f"decref of page {p} {d} time(s) but its refcount is "
                    f"{self._refcount.get(p, 0)}"
                )
        freed: list[int] = []
        for p in pages:
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                del self._refcount[p]
                heapq.heappush(self._free, p)
                self._free_set.add(p)
                freed.append(p)
        return freed

    # ---- integrity -----------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if free list and refcounts disagree."""
        assert len(self._free) == len(self._free_set), "duplicate ids in the free list"
        assert set(self._free) == self._free_set, "free heap and free set differ"
        assert NULL_PAGE not in self._free_set, "page 0 is on the free list"
        assert NULL_PAGE not in self._refcount, "page 0 is marked used"
        used = set(self._refcount)
        assert not (used & self._free_set), f"pages both free and used: {used & self._free_set}"
        assert all(c >= 1 for c in self._refcount.values()), "used page with refcount < 1"
        everything = used | self._free_set
        assert everything == set(range(1, self.num_pages)), "pages lost or out of range"
        assert self.num_free + self.num_used == self.capacity, "counts do not add up"

    def _check_id(self, page: int) -> None:
        if not (0 < page < self.num_pages):
            raise ValueError(f"page id {page} out of range 1..{self.num_pages - 1}")
