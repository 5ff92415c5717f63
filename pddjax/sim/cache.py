"""Token-budgeted LRU prefix cache, sharing one KV pool with active requests.

Models both P's prefix cache and MD's Decode-side RadixCache (DRC) at the granularity the
simulator needs: one entry per session (its latest sequence) and one per shared doc, each
with a token length. The pool holds `capacity` tokens; `reserved` of them belong to running
requests (and pinned entries) and can never be evicted; cached entries fill the rest and are
evicted least-recently-used first when a reservation or insertion needs room. A *leased*
entry (`lease` / `unlease`: P holds a prompt's pages until its KV pushes are acknowledged,
while its cache already serves the prompt) stays visible to lookups but is not evicted.

Invariant (checked by `check_integrity`): reserved + cached <= capacity.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from pddjax.sim.events import SimError


@dataclass
class Entry:
    tokens: int  # cached sequence length
    turn: int  # session entries: the turn whose sequence this is; docs: -1


class PrefixCache:
    """LRU entries + reservations within a fixed token capacity."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.reserved = 0  # tokens of running requests / pinned entries
        self.cached = 0  # tokens in `_entries`
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()  # oldest first
        self.evictions = 0
        self.peak = 0
        self._leases: dict[Hashable, int] = {}  # key -> leases held on its entry

    # ---- queries (do not modify the cache) -------------------------------------------
    def get(self, key: Hashable) -> Entry | None:
        """The entry under `key`, or None. Does not touch LRU order."""
        return self._entries.get(key)

    def free(self) -> int:
        """Tokens not reserved and not cached."""
        return self.capacity - self.reserved - self.cached

    def leased(self) -> int:
        """Tokens of cached entries that are leased (cannot be evicted now)."""
        return sum(self._entries[k].tokens for k in self._leases if k in self._entries)

    def can_reserve(self, n: int) -> bool:
        """Whether `reserve(n)` would succeed (evicting unleased cached entries if needed)."""
        return self.reserved + self.leased() + n <= self.capacity

    # ---- mutations -------------------------------------------------------------------
    def touch(self, key: Hashable) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def take(self, key: Hashable) -> Entry | None:
        """Remove an entry and move its tokens to `reserved` (pinned for a request)."""
        e = self._entries.pop(key, None)
        if e is not None:
            self.cached -= e.tokens
            self.reserved += e.tokens
        return e

    def reserve(self, n: int) -> bool:
        """Reserve n tokens, evicting LRU entries as needed; False (no change) if impossible."""
        if not self.can_reserve(n):
            return False
        self._evict_until(n)
        self.reserved += n
        self._note_peak()
        return True

    def lease(self, key: Hashable) -> None:
        """Keep `key`'s entry (and what later replaces it) from eviction until `unlease`."""
        self._leases[key] = self._leases.get(key, 0) + 1

    def unlease(self, key: Hashable) -> None:
        n = self._leases.get(key, 0) - 1
        if n < 0:
            raise SimError(f"unlease of {key!r}, which holds no lease")
        if n:
            self._leases[key] = n
        else:
            del self._leases[key]

    def release(self, n: int) -> None:
        if n > self.reserved:
            raise SimError(f"releasing {n} tokens but only {self.reserved} reserved")
        self.reserved -= n

    def insert(self, key: Hashable, tokens: int, turn: int = -1) -> bool:
        """Cache `tokens` under `key` (replacing any old entry); False if it cannot fit."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.cached -= old.tokens
        if tokens <= 0 or self.reserved + self.leased() + tokens > self.capacity:
            return False
        self._evict_until(tokens)
        self._entries[key] = Entry(tokens, turn)
        self.cached += tokens
        self._note_peak()
        return True

    def _evict_until(self, n: int) -> None:
        for key in [k for k in self._entries if k not in self._leases]:  # oldest first
            if self.free() >= n:
                return
            self.cached -= self._entries.pop(key).tokens
            self.evictions += 1

    def _note_peak(self) -> None:
        self.peak = max(self.peak, self.reserved + self.cached)

    def check_integrity(self) -> None:
        """Raise SimError if the accounting is inconsistent or over capacity."""
        total = sum(e.tokens for e in self._entries.values())
        if total != self.cached:
            raise SimError(f"cached tokens {self.cached} != sum of entries {total}")
        if self.reserved < 0 or self.reserved + self.cached > self.capacity:
            raise SimError(f"cache over capacity: {self.reserved} + {self.cached} > {self.capacity}")

    def __len__(self) -> int:
        return len(self._entries)
