"""Sampled speculation keeps the model's distribution: a two-sample chi-square test on the tiny
model. Drafts come from a fixed drafter (the rule under test is the verification, not the
lookup), chosen so that they are accepted about half the time and rejected otherwise.

Speculating engine: seeds 0..N-1; plain engine: seeds N..2N-1 (independent samples); the
statistic: the first three verified tokens (output positions 1-3) as one category, categories
with fewer than 10 draws in the two samples together pooled. Fixed seeds: the test is
deterministic; at the 0.001 level a correct verifier fails it once in 1000 seed choices.
Measured (N = 300, 2026-12-06, 16 rows a step): this verifier p = 0.18 (114 of 739 drafts
accepted; 0.84 at 32 rows a step); one that accepts every draft p ~ 2e-40 (the second test).
A subtler bug, every position of a row drawing with its first position's seed, gives only
p ~ 0.016 at this N: the statistic's power stops there, and that bug is caught by the
token-identity tests (test_speculative.py: sampled rows give plain decoding's tokens seed for
seed).
"""

import collections
import math

import pytest

from pddjax.engines import speculate
from pddjax.engines.drafter import Drafter
from pddjax.engines.paged_engine import EngineConfig, PagedEngine
from pddjax.model.sampling_params import SamplingParams
from tests.support.samples import repetitive

N = 300
TEMPERATURE = 0.1
PROMPT = repetitive(30, 5)
DRAFTS = [327, 311, 437]  # the likeliest continuation after this prompt's usual first token


class FixedDrafter(Drafter):
    def propose(self, limit):
        return DRAFTS[:limit]


def sample(tiny, speculative: str, seeds) -> tuple[list[tuple], PagedEngine]:
    """Output positions 1-3 of one request per seed -> (their tuples, the engine)."""
    # test_penalties' and test_speculative's table (their step programs serve here too), 16 rows a step
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint,
                      EngineConfig(page_size=8, num_pages=256, max_step_tokens=64, max_rows=16,
                                   speculative=speculative, spec_max_tokens=3))
    eng.step_costs = None  # every draft verified, whatever its acceptance (test_spec_costs covers the rule)
    out, seeds = {}, list(seeds)
    for w in range(0, len(seeds), 32):  # 32 requests at a time (160 of the pool's 255 pages)
        for s in seeds[w:w + 32]:
            eng.add(str(s), PROMPT, SamplingParams(temperature=TEMPERATURE, seed=s), 4, ())
        while eng.has_work():
            for ev in eng.step():
                out.setdefault(ev.seq_id, []).append(ev.token)
        eng.check_integrity()
    return [tuple(v[1:4]) for v in out.values()], eng


def chi_square_p(a: list, b: list, min_count: int = 10) -> float:
    """Two-sample chi-square homogeneity test -> p-value (Wilson-Hilferty's approximation)."""
    both = collections.Counter(a) + collections.Counter(b)
    pool = lambda x: x if both[x] >= min_count else "other"  # noqa: E731
    ca, cb = collections.Counter(map(pool, a)), collections.Counter(map(pool, b))
    cats = sorted(set(ca) | set(cb), key=str)
    na, nb = len(a), len(b)
    stat = 0.0
    for c in cats:
        tot = ca[c] + cb[c]
        for n, obs in ((na, ca[c]), (nb, cb[c])):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    k = len(cats) - 1
    assert k >= 3, f"only {k + 1} categories: the test has no power"
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture
def fixed_drafts(monkeypatch):
    monkeypatch.setattr(speculate, "new_drafter", lambda seq, k: FixedDrafter(seq.all_tokens(), k))


def test_sampled_distribution_is_unchanged(tiny, fixed_drafts):
    spec, eng = sample(tiny, "ngram", range(N))
    assert 0.05 < eng.spec_accepted / eng.spec_drafted < 0.95, "drafts must be both accepted and rejected"
    plain, _ = sample(tiny, "off", range(N, 2 * N))
    assert chi_square_p(spec, plain) > 1e-3


def test_the_statistic_sees_a_verifier_that_accepts_every_draft(tiny, fixed_drafts, monkeypatch):
    real = speculate.accept
    monkeypatch.setattr(speculate, "accept", lambda seq, drafts, tokens: real(seq, drafts, [*drafts, tokens[-1]]))
    broken, _ = sample(tiny, "ngram", range(N))
    plain, _ = sample(tiny, "off", range(N, 2 * N))
    assert chi_square_p(broken, plain) < 1e-6

