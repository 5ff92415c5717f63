"""The prompt-lookup drafter: index kept by appends only, longest match wins, adaptive k."""

import random

import pytest

from pddjax.engines import drafter as dmod
from pddjax.engines.drafter import Drafter


def test_longest_recent_ngram_proposes_its_continuation():
    # "1 2 3" occurs twice with different continuations: the latest (-> 7 8) wins
    d = Drafter([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 2, 3], max_tokens=2, min_ngram=1)
    assert d.propose(8) == [7, 8]  # suffix "2 3": latest earlier occurrence followed by 7 8
    d.extend([1])
    assert d.propose(8) == [2, 3]  # "2 3 1", "3 1" never seen: "1" -> 2 3
    d.check_integrity()


def test_no_match_and_limit():
    d = Drafter([1, 2, 3, 4], max_tokens=4, min_ngram=1)
    assert d.propose(4) == []  # suffix 4 never seen before
    d.extend([2])
    assert d.propose(4) == [3, 4, 2, 3]  # the continuation runs into the suffix: repeats its period
    assert d.propose(2) == [3, 4]
    assert d.propose(0) == []


def test_the_suffix_itself_is_not_a_match():
    d = Drafter([5], max_tokens=3, min_ngram=1)
    assert d.propose(3) == []
    d.extend([5])
    assert d.propose(3) == [5, 5, 5]  # an earlier 5 was followed by 5: a loop keeps looping


def test_index_grows_by_appends_only_and_matches_a_rescan():
    rng = random.Random(0)
    d = Drafter([rng.randrange(6) for _ in range(50)], max_tokens=4, max_ngram=4, min_ngram=1)
    context = list(d.tokens)
    for _ in range(40):
        new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        context += new
        d.sync(context)
        d.check_integrity()
    context = context[:30]  # a rollback
    d.sync(context)
    d.check_integrity()
    assert d.tokens == context


def test_sync_reads_only_new_tokens(monkeypatch):
    d = Drafter(list(range(100)), max_tokens=4)
    seen = []
    real = Drafter.extend
    monkeypatch.setattr(Drafter, "extend", lambda self, toks: (seen.append(len(toks)), real(self, toks)))
    d.sync(list(range(100)) + [7, 8])
    assert seen == [2]


def test_check_integrity_catches_a_stale_index():
    d = Drafter([1, 2, 3, 1, 2], max_tokens=4)
    d.index[(1, 2)] = 0
    with pytest.raises(AssertionError):
        d.check_integrity()


def test_k_adapts_turns_off_and_recovers_by_probes():
    d = Drafter([1, 2, 3, 1, 2, 3, 1, 2], max_tokens=8)
    assert d.k == 8
    d.feedback(8, 3)
    assert d.k == 4  # accepted + 1
    d.feedback(4, 4)
    assert d.k == 8  # a whole draft accepted: doubles, bounded
    for _ in range(10):
        d.feedback(max(d.k, 1), 0)
    assert d.k == 0 and d.acceptance < dmod.OFF_BELOW
    drafts = [d.propose(8) for _ in range(dmod.PROBE_EVERY)]
    assert drafts[:-1] == [[]] * (dmod.PROBE_EVERY - 1) and len(drafts[-1]) == 1  # the probe
    for _ in range(6):  # probes accepted: the average climbs back over the bar
        d.feedback(1, 1)
    assert d.k >= 1
    d.check_integrity()


def test_rejected_probes_wait_longer_and_an_accepted_one_resets_the_wait():
    """A row with nothing to copy: each rejected probe doubles the wait before the next (8, 16,
    32, 64, 64 proposals), so over a long output it verifies a handful of probes, not one in 8;
    an accepted probe brings the wait back to PROBE_EVERY."""
    d = Drafter([1, 2, 3, 1, 2, 3, 1, 2], max_tokens=4)
    assert d.acceptance == dmod.PRIOR and d.k == 4
    for _ in range(10):
        d.feedback(max(d.k, 1), 0)
    assert d.k == 0

    def wait_for_probe() -> int:
        for n in range(1, 10 * dmod.PROBE_EVERY_MAX):
            if d.propose(4):
                return n
        raise AssertionError("no probe")

    waits = []
    for _ in range(5):
        waits.append(wait_for_probe())
        d.feedback(1, 0)
    assert waits == [dmod.PROBE_EVERY * 2**i for i in range(4)] + [dmod.PROBE_EVERY_MAX], waits
    assert wait_for_probe() == 64
    d.feedback(1, 1)  # accepted: the row drafts again, and once off again waits the first wait
    assert d.k >= 1
    while d.k:
        d.feedback(d.k, 0)
    assert wait_for_probe() == dmod.PROBE_EVERY
    d.check_integrity()


def test_a_lone_token_seen_before_proposes_nothing_by_default():
    """MIN_NGRAM = 2: "... 9 4" after an earlier "4 7" is no match, "3 4" after an earlier "3 4 7" is."""
    d = Drafter([1, 2, 3, 4, 7, 8, 9, 4], max_tokens=2)
    assert d.min_ngram == dmod.MIN_NGRAM == 2 and d.propose(4) == []
    assert Drafter(list(d.tokens), max_tokens=2, min_ngram=1).propose(4) == [7, 8]
    d.extend([5, 3, 4])
    assert d.propose(4) == [7, 8]
    assert all(len(gram) >= 2 for gram in d.index)
    d.check_integrity()


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="spec_max_tokens"):
        Drafter([1], max_tokens=0)
    with pytest.raises(ValueError, match="n-gram"):
        Drafter([1], max_tokens=2, min_ngram=4)
    d = Drafter([1], max_tokens=2)
    with pytest.raises(ValueError, match="accepted"):
        d.feedback(2, 3)
