"""Page-granular radix (prefix) cache over KV pages (host side, no jax).

Contract: `RadixCache(page_size, allocator)` stores full KV pages in a tree whose every node
holds exactly one page; a node's children are keyed by their chained page hash
(`page_hash.page_hash`), so a path root..node names a token prefix, and a peer can ask
"how many of these pages do you hold?" by hashes alone (`match_hashes`, used by P to send MD
only the pages its decode-side cache lacks).

Reference protocol (every holder of a page owns one allocator reference):
  * The cache owns ONE reference on every page it stores; `insert` increfs the caller's page
    for each NEW node, and `evict` decrefs the page of each removed node.
  * A running sequence owns its own reference on every page in its page table, cached ones
    included: after `m = match_prefix(prompt)` the engine calls `lock(m.last_node)` FIRST
    (an `evict` to make room between match and lock could drop the matched pages), then
    `allocator.incref(m.pages)`, then allocates the rest (evicting if short; if it still
    cannot, `unlock(m.last_node)` and retry later).
  * When it finishes: `insert(tokens, seq_pages)` (duplicates of pages already cached are
    not taken), `unlock(m.last_node)`, then `allocator.decref(seq_pages)`; pages nobody else
    holds (a partial last page, duplicate pages) become free right there.
  * `lock` keeps the path root..node out of `evict`; nodes are never evicted while locked.

LRU uses a logical clock (an operation counter), never wall time. `insert` and `touch`
stamp every node on the path; `match_prefix`, `match_hashes`, `lock` and `unlock` do not.
Hence a parent's last_access is always >= its children's, and evicting the least recently
used unlocked leaf, repeatedly, is a consistent LRU over prefixes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

from pddjax.kv.allocator import NULL_PAGE, PageAllocator
from pddjax.kv.page_hash import ROOT_HASH, chain_hashes, page_hash


class RadixNode:
    """One full page of a cached prefix. The root holds no page (page is None)."""

    __slots__ = ("tokens", "hash", "page", "parent", "children", "last_access", "lock_ref", "uid")

    def __init__(self, tokens: tuple[int, ...], h: int, page: int | None,
                 parent: RadixNode | None, uid: int):
        self.tokens = tokens  # (page_size,) token ids of this page; () for the root
        self.hash = h  # chained hash of the prefix ending with this page
        self.page = page  # KV page id; None for the root
        self.parent = parent  # None for the root and for evicted (detached) nodes
        self.children: dict[int, RadixNode] = {}  # child page hash -> child
        self.last_access = 0  # logical clock of the last insert/touch through this node
        self.lock_ref = 0  # number of locks on paths through this node
        self.uid = uid  # creation order; breaks LRU ties deterministically


class PrefixMatch(NamedTuple):
    num_tokens: int  # matched tokens, a multiple of page_size
    pages: list[int]  # [num_tokens // page_size] page ids, in order
    hashes: list[int]  # [num_tokens // page_size] chained page hashes, in order
    last_node: RadixNode  # deepest matched node (the root if nothing matched)


class RadixCache:
    """Prefix cache of full KV pages; holds one allocator reference per stored page."""

    def __init__(self, page_size: int, allocator: PageAllocator):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self._root = RadixNode((), ROOT_HASH, None, None, uid=0)
        self._next_uid = 1
        self._clock = 0
        self._page_to_node: dict[int, RadixNode] = {}  # stored page -> its node
        self._num_evictable = 0  # stored nodes with lock_ref == 0

    @property
    def root(self) -> RadixNode:
        return self._root

    @property
    def num_pages(self) -> int:
        """Pages stored in the cache."""
        return len(self._page_to_node)

    @property
    def num_evictable(self) -> int:
        """Nodes `evict` could remove now (unlocked; their pages free unless held elsewhere)."""
        return self._num_evictable

    # ---- lookups (no mutation) -------------------------------------------------------
    def cached_pages(self) -> set[int]:
        """Ids of every page the cache stores."""
        return set(self._page_to_node)

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        """Longest cached full-page prefix of `tokens`.

        This operation does not modify the cache (not even LRU clocks).
        """
        node = self._root
        pages: list[int] = []
        hashes: list[int] = []
        ps = self.page_size
        for i, h in enumerate(chain_hashes(tokens, ps)):
            child = node.children.get(h)
            if child is None or child.tokens != tuple(tokens[i * ps:(i + 1) * ps]):
                break
            node = child
            pages.append(child.page)
            hashes.append(h)
        return PrefixMatch(len(pages) * ps, pages, hashes, node)

    def match_hashes(self, hashes: Sequence[int]) -> int:
        """Number of leading chained page hashes present in the cache.

        This operation does not modify the cache.
        """
        node = self._root
        n = 0
        for h in hashes:
            node = node.children.get(h)
            if node is None:
                break
            n += 1
        return n

    # ---- mutations -------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Store the full pages of `tokens`, whose KV lives in `pages`; return #new nodes.

        Needs len(pages) >= len(tokens) // page_size. Existing nodes are kept (the caller's
        duplicate page is not taken); each new node increfs the caller's page. Stamps the
        whole path with a new LRU clock. Validates before mutating: on error nothing changes.
        """
        ps = self.page_size
        hashes = chain_hashes(tokens, ps)
        if len(pages) < len(hashes):
            raise ValueError(f"{len(hashes)} full pages of tokens but only {len(pages)} page ids")
        # Dry walk: find where the existing path ends.
        node, depth = self._root, 0
        while depth < len(hashes):
            child = node.children.get(hashes[depth])
            if child is None:
                break
            if child.tokens != tuple(tokens[depth * ps:(depth + 1) * ps]):
                raise RuntimeError(f"page hash collision at page {depth}")
            node, depth = child, depth + 1
        new_pages = [int(p) for p in pages[depth:len(hashes)]]
        for p in new_pages:
            if p == NULL_PAGE or p in self._page_to_node or self.allocator.refcount(p) < 1:
                raise ValueError(f"page {p} is reserved, already cached, or not allocated")
        if len(set(new_pages)) != len(new_pages):
            raise ValueError(f"duplicate page ids in {new_pages}")
        # Commit.
        self.allocator.incref(new_pages)
        for i, p in enumerate(new_pages, start=depth):
            child = RadixNode(tuple(int(t) for t in tokens[i * ps:(i + 1) * ps]),
                              hashes[i], p, node, self._next_uid)
            self._next_uid += 1
            node.children[child.hash] = child
            self._page_to_node[p] = child
            self._num_evictable += 1
            node = child
        self.touch(node)
        return len(new_pages)

    def touch(self, last_node: RadixNode) -> None:
        """Stamp every node on the path root..last_node with a new LRU clock."""
        self._clock += 1
        for n in self._path(last_node):
            n.last_access = self._clock

    def lock(self, last_node: RadixNode) -> None:
        """Protect the path root..last_node from eviction (one lock_ref per node)."""
        for n in self._path(last_node):
            if n.lock_ref == 0:
                self._num_evictable -= 1
            n.lock_ref += 1

    def unlock(self, last_node: RadixNode) -> None:
        """Undo one `lock(last_node)`. Raises ValueError (changing nothing) below zero."""
        path = self._path(last_node)
        if any(n.lock_ref <= 0 for n in path):
            raise ValueError("unlock of a node that is not locked")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._num_evictable += 1

    def evict(self, num_pages: int) -> int:
        """Remove least-recently-used unlocked leaves (parents become leaves in turn) until
        `num_pages` nodes are gone or none is evictable; decref their pages. Returns #evicted.
        """
        heap = [(n.last_access, n.uid, n) for n in self._page_to_node.values()
                if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        evicted = 0
        while heap and evicted < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.hash]
            del self._page_to_node[node.page]
            node.parent = None  # detached: lock/touch on it now raise
            self._num_evictable -= 1
            self.allocator.decref([node.page])
            evicted += 1
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return evicted

    # ---- integrity -------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if the tree, hashes, locks, counts or refcounts disagree."""
        root = self._root
        assert root.parent is None and root.page is None and root.lock_ref == 0
        seen: dict[int, RadixNode] = {}
        evictable = 0
        stack = [root]
        while stack:
            node = stack.pop()
            if node is not root:
                assert sum(c.lock_ref for c in node.children.values()) <= node.lock_ref, \
                    "a parent has fewer locks than its children together"
            for key, child in node.children.items():
                assert child.parent is node, "child's parent pointer is wrong"
                assert key == child.hash, "child is keyed by the wrong hash"
                assert len(child.tokens) == self.page_size, "node does not hold a full page"
                assert child.hash == page_hash(node.hash, child.tokens), "hash does not chain"
                assert child.lock_ref >= 0, "negative lock_ref"
                assert node is root or node.last_access >= child.last_access, "LRU clock order"
                p = child.page
                assert p is not None and p != NULL_PAGE, f"bad page id {p}"
                assert p not in seen, f"page {p} stored twice"
                assert self.allocator.refcount(p) >= 1, f"stored page {p} is free"
                seen[p] = child
                evictable += child.lock_ref == 0
                stack.append(child)
        assert seen.keys() == self._page_to_node.keys(), "page index out of sync with tree"
        assert all(seen[p] is n for p, n in self._page_to_node.items()), "page index wrong node"
        assert evictable == self._num_evictable, "evictable count out of sync"

    def _path(self, last_node: RadixNode) -> list[RadixNode]:
        """Nodes root..last_node, root excluded. Raises ValueError if last_node was evicted."""
        path = []
        n = last_node
        while n is not self._root:
            if n.parent is None:
                raise ValueError("node is not in this cache (evicted or foreign)")
            path.append(n)
            n = n.parent
        return path
