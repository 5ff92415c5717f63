"""RadixCache, read like its spec: lookups do not mutate, inserts deduplicate, locks beat
eviction, eviction is LRU, hashes are portable. Ends with a randomized state-machine test."""

import os
import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pddjax.kv.allocator import PageAllocator
from pddjax.kv.page_hash import ROOT_HASH, chain_hashes, extend_hashes, page_hash
from pddjax.kv.page_table import pages_needed
from pddjax.kv.radix_cache import RadixCache

PS = 4  # page size used throughout


def make(num_pages=32):
    a = PageAllocator(num_pages)
    return a, RadixCache(PS, a)


def snapshot(cache):
    """Everything a lookup must leave unchanged."""
    out, stack = [], [cache.root]
    while stack:
        n = stack.pop()
        out.append((n.uid, n.hash, n.page, n.last_access, n.lock_ref, tuple(n.children)))
        stack.extend(n.children.values())
    return sorted(out), cache._clock, cache.num_pages, cache.num_evictable


def cached(cache, a, tokens):
    """Allocate pages for `tokens`, insert them, drop the caller's refs (cache keeps its own)."""
    pages = a.allocate(pages_needed(len(tokens), PS))
    n = cache.insert(tokens, pages)
    a.decref(pages)
    return pages, n


def test_empty_cache_matches_nothing():
    _, c = make()
    m = c.match_prefix(list(range(10)))
    assert (m.num_tokens, m.pages, m.hashes, m.last_node) == (0, [], [], c.root)


def test_match_returns_full_pages_only():
    a, c = make()
    pages, n = cached(c, a, list(range(10)))  # 2 full pages + 2 tokens
    assert n == 2 and c.num_pages == 2
    m = c.match_prefix(list(range(12)))
    assert m.num_tokens == 8 and m.pages == pages[:2]
    assert m.hashes == chain_hashes(list(range(8)), PS)
    assert c.match_prefix([0, 1, 2, 3, 9, 9, 9, 9]).pages == pages[:1]
    assert a.num_used == 2  # the partial page went back when the caller dropped it
    c.check_integrity()
    a.check_integrity()


def test_match_does_not_mutate():
    a, c = make()
    cached(c, a, list(range(12)))
    before = snapshot(c)
    c.match_prefix(list(range(12)))
    c.match_prefix(list(range(5)))
    c.match_hashes(chain_hashes(list(range(12)), PS))
    assert snapshot(c) == before


def test_insert_twice_keeps_one_copy_and_returns_zero():
    a, c = make()
    first, n = cached(c, a, list(range(8)))
    assert n == 2
    dup = a.allocate(2)
    assert c.insert(list(range(8)), dup) == 0
    assert [a.refcount(p) for p in dup] == [1, 1]  # caller's duplicate pages not taken
    assert c.match_prefix(list(range(8))).pages == first
    assert a.decref(dup) == dup
    c.check_integrity()


def test_insert_extends_an_existing_prefix_with_callers_pages():
    a, c = make()
    first, _ = cached(c, a, list(range(8)))
    mine = a.allocate(3)
    assert c.insert(list(range(12)), mine) == 1
    assert c.match_prefix(list(range(12))).pages == first + mine[2:]
    assert [a.refcount(p) for p in mine] == [1, 1, 2]


def test_insert_validates_before_mutating():
    a, c = make()
    with pytest.raises(ValueError):
        c.insert(list(range(8)), [5, 6])  # not allocated
    with pytest.raises(ValueError):
        c.insert(list(range(8)), a.allocate(1))  # too few pages
    p = a.allocate(1)
    with pytest.raises(ValueError):
        c.insert(list(range(8)), p + p)  # same page twice
    assert c.num_pages == 0 and a.refcount(p[0]) == 1
    c.check_integrity()


def test_eviction_never_frees_a_locked_page():
    a, c = make()
    locked_pages, _ = cached(c, a, [1] * 8)
    other, _ = cached(c, a, [2] * 8)
    m = c.match_prefix([1] * 8)
    c.lock(m.last_node)
    assert c.num_evictable == 2
    assert c.evict(10) == 2
    assert c.match_prefix([1] * 8).pages == locked_pages
    assert all(a.refcount(p) == 1 for p in locked_pages)
    assert all(a.refcount(p) == 0 for p in other)
    c.unlock(m.last_node)
    assert c.evict(10) == 2 and c.num_pages == 0 and a.num_used == 0
    c.check_integrity()


def test_partially_locked_path_keeps_the_locked_prefix():
    a, c = make()
    cached(c, a, list(range(12)))
    c.lock(c.match_prefix(list(range(4))).last_node)
    assert c.evict(10) == 2
    assert c.match_prefix(list(range(12))).num_tokens == 4


def test_lru_order_and_touch():
    a, c = make()
    pa, _ = cached(c, a, [1] * 4)
    pb, _ = cached(c, a, [2] * 4)
    pc, _ = cached(c, a, [3] * 4)
    c.touch(c.match_prefix([1] * 4).last_node)  # now B is the oldest
    assert c.evict(1) == 1
    assert c.match_prefix([2] * 4).num_tokens == 0
    assert a.refcount(pb[0]) == 0
    assert c.evict(1) == 1 and c.match_prefix([3] * 4).num_tokens == 0
    assert c.match_prefix([1] * 4).pages == pa


def test_insert_refreshes_lru_even_for_existing_pages():
    a, c = make()
    cached(c, a, [1] * 4)
    cached(c, a, [2] * 4)
    cached(c, a, [1] * 4)  # already cached: returns 0 but counts as a use
    assert c.evict(1) == 1
    assert c.match_prefix([2] * 4).num_tokens == 0
    assert c.match_prefix([1] * 4).num_tokens == 4


def test_eviction_cascades_leaf_first():
    a, c = make()
    pages, _ = cached(c, a, list(range(12)))
    assert c.evict(1) == 1
    assert c.match_prefix(list(range(12))).pages == pages[:2]  # the deepest page went
    assert c.evict(5) == 2 and c.num_pages == 0


def test_match_hashes_equals_match_prefix_length():
    a, c = make()
    cached(c, a, list(range(12)))
    cached(c, a, list(range(8)) + [9] * 8)
    for toks in (list(range(12)), list(range(16)), list(range(8)) + [9] * 8,
                 list(range(8)) + [9] * 4 + [5] * 4, [7] * 8, []):
        m = c.match_prefix(toks)
        assert c.match_hashes(chain_hashes(toks, PS)) * PS == m.num_tokens


def test_two_caches_produce_identical_hashes():
    toks = list(range(100, 120))
    a1, c1 = make()
    a2, c2 = make()
    a2.allocate(5)  # different page ids, same content
    cached(c1, a1, toks)
    cached(c2, a2, toks)
    m1, m2 = c1.match_prefix(toks), c2.match_prefix(toks)
    assert m1.hashes == m2.hashes and m1.pages != m2.pages
    assert c2.match_hashes(m1.hashes) == 5


def test_hashes_are_stable_across_processes():
    # Pinned value: blake2b-8 over 8 zero bytes + int32 LE tokens 0..3.
    assert chain_hashes(list(range(8)), 4) == [5919486166599431679, 3142802598544154706]
    code = "from pddjax.kv.page_hash import chain_hashes; print(chain_hashes(list(range(8)), 4))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[5919486166599431679, 3142802598544154706]"


def test_hash_chaining_helpers():
    toks = list(range(22))
    hs = chain_hashes(toks, PS)
    assert len(hs) == 5 and hs[0] == page_hash(ROOT_HASH, toks[:4])
    assert hs[1] == page_hash(hs[0], toks[4:8])
    assert extend_hashes(hs[:2], toks, PS) == hs


def test_lock_errors():
    a, c = make()
    cached(c, a, list(range(8)))
    node = c.match_prefix(list(range(8))).last_node
    with pytest.raises(ValueError):
        c.unlock(node)
    c.evict(2)
    with pytest.raises(ValueError):
        c.lock(node)  # evicted node


def test_check_integrity_catches_corruption():
    a, c = make()
    cached(c, a, list(range(8)))
    node = c.match_prefix(list(range(8))).last_node
    node.lock_ref = 1  # child locked, parent not
    with pytest.raises(AssertionError):
        c.check_integrity()
    node.lock_ref = 0
    node.tokens = (9, 9, 9, 9)
    with pytest.raises(AssertionError):
        c.check_integrity()


# ---- randomized: the engine's protocol under random interleavings ---------------------

BASES = ([0] * 16, [0] * 8 + [1] * 8, [2] * 16)  # prompts share prefixes like agent turns
TOKENS = st.builds(lambda b, n, tail: BASES[b][:n] + tail, st.integers(0, 2),
                   st.integers(0, 16), st.lists(st.integers(0, 2), max_size=5))


class CacheMachine(RuleBasedStateMachine):
    """Requests follow the documented protocol: match, lock, (evict,) incref cached pages,
    allocate the rest; finish = insert, unlock, decref. Raw allocations stand in for other users."""

    def __init__(self):
        super().__init__()
        self.a = PageAllocator(14)
        self.c = RadixCache(PS, self.a)
        self.requests = []  # [tokens, pages, locked last_node]
        self.raw = []  # pages held by a non-cache user

    @rule(tokens=TOKENS)
    def start_request(self, tokens):
        m = self.c.match_prefix(tokens)
        need = pages_needed(len(tokens), PS) - len(m.pages)
        self.c.lock(m.last_node)  # lock BEFORE evicting to make room, or the match may go
        if not self.a.can_allocate(need):
            self.c.evict(need - self.a.num_free)
        if not self.a.can_allocate(need):
            self.c.unlock(m.last_node)
            return
        self.a.incref(m.pages)
        self.requests.append([tokens, m.pages + self.a.allocate(need), m.last_node])

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100), insert=st.booleans())
    def finish_request(self, i, insert):
        tokens, pages, node = self.requests.pop(i % len(self.requests))
        if insert:
            self.c.insert(tokens, pages)
        self.c.unlock(node)
        self.a.decref(pages)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100))
    def cache_unfinished(self, i):
        req = self.requests[i % len(self.requests)]
        self.c.insert(req[0], req[1])
        m = self.c.match_prefix(req[0])
        assert m.num_tokens == len(req[0]) // PS * PS  # every full page is now cached
        self.c.lock(m.last_node)
        self.c.unlock(req[2])
        req[2] = m.last_node

    @rule(n=st.integers(0, 3))
    def raw_allocate(self, n):
        if self.a.can_allocate(n):
            self.raw += self.a.allocate(n)

    @precondition(lambda self: self.raw)
    @rule()
    def raw_free(self):
        self.a.decref([self.raw.pop()])

    @rule(n=st.integers(0, 8))
    def evict(self, n):
        locked = self._locked_nodes()
        evictable = self.c.num_evictable
        assert evictable == self.c.num_pages - len(locked)
        assert self.c.evict(n) == min(n, evictable)  # every unlocked node is reachable
        assert locked <= self._locked_nodes(), "a locked node was evicted"
        for _, pages, _ in self.requests:
            assert all(self.a.refcount(p) >= 1 for p in pages)

    @rule(tokens=TOKENS)
    def match(self, tokens):
        before = snapshot(self.c)
        m = self.c.match_prefix(tokens)
        assert self.c.match_hashes(chain_hashes(tokens, PS)) * PS == m.num_tokens
        assert snapshot(self.c) == before

    @invariant()
    def integrity(self):
        self.a.check_integrity()
        self.c.check_integrity()
        for tokens, _pages, node in self.requests:
            assert self.c.match_prefix(tokens).num_tokens >= len(self.c._path(node)) * PS

    def _locked_nodes(self):
        out, stack = set(), [self.c.root]
        while stack:
            n = stack.pop()
            out |= {ch.uid for ch in n.children.values() if ch.lock_ref > 0}
            stack.extend(n.children.values())
        return out

    def teardown(self):
        while self.requests:
            self.finish_request(0, True)
        self.a.decref(self.raw)
        self.c.evict(10**9)
        assert self.c.num_pages == 0 and self.c.num_evictable == 0
        assert self.a.num_free == self.a.capacity and self.a.num_used == 0
        self.c.check_integrity()
        self.a.check_integrity()


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
