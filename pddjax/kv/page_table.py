"""Per-sequence KV page list and its page-table row (host side, no jax).

Contract: `SequencePages(page_size)` records which KV pages hold a sequence's tokens, in
order: token at position t lives in page `pages[t // page_size]` at offset
`t % page_size`. `num_tokens` counts positions whose KV has been written; `num_cached`
counts the leading tokens that came from a prefix cache (shared pages, never written by
this sequence). `table_row` is the row an engine feeds to attention, padded with page 0,
the reserved scratch page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pddjax.kv.allocator import NULL_PAGE


def pages_needed(total_tokens: int, page_size: int) -> int:
    """Pages required to hold `total_tokens` tokens: ceil(total_tokens / page_size)."""
    if total_tokens < 0 or page_size <= 0:
        raise ValueError(f"bad total_tokens={total_tokens} or page_size={page_size}")
    return -(-total_tokens // page_size)


@dataclass
class SequencePages:
    """Page ids of one sequence plus how much of it is written and how much was cached."""

    page_size: int
    pages: list[int] = field(default_factory=list)  # [num_pages] page ids in token order
    num_tokens: int = 0  # tokens whose KV is written (cached ones included)
    num_cached: int = 0  # leading tokens taken from a prefix cache (multiple of page_size)

    @property
    def capacity(self) -> int:
        """Tokens the current pages can hold."""
        return len(self.pages) * self.page_size

    def extra_pages_needed(self, total_tokens: int) -> int:
        """Pages to allocate so that `total_tokens` tokens fit (0 if they already do)."""
        return max(0, pages_needed(total_tokens, self.page_size) - len(self.pages))

    def slot_of(self, position: int) -> tuple[int, int]:
        """(page id, offset in page) where the KV of token `position` lives."""
        if not 0 <= position < self.capacity:
            raise IndexError(f"position {position} outside 0..{self.capacity - 1}")
        return self.pages[position // self.page_size], position % self.page_size

    def slots(self, positions: Sequence[int]) -> np.ndarray:
        """[N, 2] int32 rows of (page id, offset) for each position."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)  # [N]
        if pos.size and (pos.min() < 0 or pos.max() >= self.capacity):
            raise IndexError(f"positions outside 0..{self.capacity - 1}")
        table = np.asarray(self.pages, dtype=np.int32)  # [num_pages]
        out = np.empty((pos.size, 2), dtype=np.int32)  # [N, 2]
        out[:, 0] = table[pos // self.page_size] if pos.size else 0
        out[:, 1] = pos % self.page_size
        return out

    def table_row(self, max_pages: int) -> np.ndarray:
        """[max_pages] int32 page ids, padded with page 0 (the scratch page)."""
        if len(self.pages) > max_pages:
            raise ValueError(f"sequence has {len(self.pages)} pages > max_pages={max_pages}")
        row = np.full((max_pages,), NULL_PAGE, dtype=np.int32)  # [max_pages]
        row[: len(self.pages)] = self.pages
        return row

    def check_integrity(self) -> None:
        """Raise AssertionError if counts and pages disagree."""
        assert 0 <= self.num_cached <= self.num_tokens <= self.capacity, (
            f"need 0 <= num_cached ({self.num_cached}) <= num_tokens ({self.num_tokens}) "
            f"<= capacity ({self.capacity})")
        assert self.num_cached % self.page_size == 0, "num_cached is not page-aligned"
        assert NULL_PAGE not in self.pages, "page 0 in a sequence's page list"
        assert len(set(self.pages)) == len(self.pages), "page listed twice"
