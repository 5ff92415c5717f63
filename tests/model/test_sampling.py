"""Sampling: the draw for output position t depends only on (seed, t)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pddjax.model.sampling import argmax, sample
from pddjax.model.sampling_params import SamplingParams

sample_jit = jax.jit(sample)


def _sample(logits, seed, step, temp=1.0, k=0, p=1.0):
    B = logits.shape[0]
    full = lambda v, dt: jnp.full((B,), v, dt)  # noqa: E731
    return np.asarray(sample_jit(jnp.asarray(logits), full(seed, jnp.int32), full(step, jnp.int32),
                             full(temp, jnp.float32), full(k, jnp.int32), full(p, jnp.float32)))


def test_same_seed_and_step_same_token_regardless_of_batch_position():
    logits = np.random.default_rng(0).standard_normal((4, 100)).astype(np.float32)
    logits[:] = logits[0]  # four identical rows
    toks = _sample(logits, seed=7, step=3)
    assert len(set(toks.tolist())) == 1
    single = _sample(logits[:1], seed=7, step=3)
    assert single[0] == toks[0]


def test_different_steps_draw_differently():
    logits = np.zeros((1, 1000), np.float32)  # uniform: any token possible
    draws = {int(_sample(logits, seed=1, step=t)[0]) for t in range(20)}
    assert len(draws) > 10


def test_the_draws_follow_the_softmax():
    """Chi-square over 6 tokens, 3,000 draws (one step each, seed 11): the statistic's 5 degrees
    of freedom put its 0.1% tail at 20.5; a sampler off by 0.03 in one token's probability
    exceeds it in most runs."""
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))
    steps = jnp.arange(3000, dtype=jnp.int32)
    B = steps.shape[0]
    toks = np.asarray(sample_jit(jnp.tile(jnp.asarray(logits), (B, 1)), jnp.full((B,), 11, jnp.int32), steps,
                                 jnp.ones((B,), jnp.float32), jnp.zeros((B,), jnp.int32), jnp.ones((B,), jnp.float32)))
    seen = np.bincount(toks, minlength=6)
    expected = np.exp(logits) / np.exp(logits).sum() * B
    assert ((seen - expected) ** 2 / expected).sum() < 20.5, seen


def test_a_small_change_in_the_logits_keeps_the_draw():
    """The real model's vocabulary size, flat-ish logits (an open-ended answer): logits 1e-4
    apart (what another step shape's summation order gives the real model) draw the same token
    for the same (seed, step) in all but a handful of 2,000 draws (the inverse-CDF draw this
    replaced flipped 29 of them)."""
    rng = np.random.default_rng(4)
    logits = (2.0 * rng.standard_normal((1, 49152))).astype(np.float32)
    nudged = (logits + 1e-4 * rng.standard_normal(logits.shape)).astype(np.float32)
    flips = 0
    for start in range(0, 2000, 250):
        n = 250
        args = (jnp.full((n,), 5, jnp.int32), jnp.arange(start, start + n, dtype=jnp.int32),
                jnp.ones((n,), jnp.float32), jnp.zeros((n,), jnp.int32), jnp.ones((n,), jnp.float32))
        a = np.asarray(sample_jit(jnp.tile(jnp.asarray(logits), (n, 1)), *args))
        b = np.asarray(sample_jit(jnp.tile(jnp.asarray(nudged), (n, 1)), *args))
        flips += int((a != b).sum())
    assert flips <= 3, flips


def test_greedy_and_degenerate_filters_equal_argmax():
    logits = np.random.default_rng(2).standard_normal((8, 50)).astype(np.float32)
    argmax = logits.argmax(-1)
    assert (_sample(logits, 3, 0, temp=0.0) == argmax).all()
    assert (_sample(logits, 3, 0, temp=1.0, k=1) == argmax).all()
    assert (_sample(logits, 3, 0, temp=1.0, p=1e-6) == argmax).all()


def test_argmax_is_numpys_first_index_of_the_largest():
    """Ties (the first wins), a row of -inf, a row holding +inf, small and wide vocabularies."""
    rng = np.random.default_rng(5)
    for B, V in ((7, 3), (16, 512), (4, 49152)):
        x = rng.integers(-3, 3, (B, V)).astype(np.float32)  # many ties
        x[0] = -np.inf
        x[1, V // 2] = np.inf
        x[2] = rng.standard_normal(V).astype(np.float32)
        got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    nan = np.zeros((1, 10), np.float32)
    nan[0, 3] = np.nan
    assert 0 <= int(argmax(jnp.asarray(nan))[0]) < 10  # never an out-of-vocabulary id


def test_top_k_limits_support():
    logits = np.random.default_rng(3).standard_normal((1, 50)).astype(np.float32)
    top3 = set(np.argsort(-logits[0])[:3].tolist())
    draws = {int(_sample(logits, 0, t, temp=5.0, k=3)[0]) for t in range(60)}
    assert draws <= top3 and len(draws) > 1


def test_top_p_keeps_smallest_nucleus():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    draws = {int(_sample(logits, 0, t, temp=1.0, p=0.7)[0]) for t in range(60)}
    assert draws == {0, 1}


@pytest.mark.parametrize("bad", [SamplingParams(temperature=-0.1), SamplingParams(top_p=0.0),
                                 SamplingParams(top_p=1.5), SamplingParams(top_k=-1), SamplingParams(seed=-1)])
def test_bad_params_are_refused(bad):
    with pytest.raises(ValueError):
        bad.validate()


def test_bisection_filters_match_a_sorting_reference():
    """Draws stay inside the nucleus/top-k set computed by sorting (numpy)."""
    rng = np.random.default_rng(5)
    for trial in range(4):
        logits = (rng.standard_normal((1, 300)) * 3).astype(np.float32)
        temp, k, p = 0.8, int(rng.integers(0, 40)), float(rng.uniform(0.3, 0.95))
        order = np.argsort(-logits[0] / temp)
        keep = order[:k] if k else order
        probs = np.exp(logits[0, keep] / temp - (logits[0, keep] / temp).max())
        probs /= probs.sum()
        cum_before = np.cumsum(probs) - probs
        allowed = set(keep[cum_before < p].tolist())
        draws = {int(_sample(logits, trial, t, temp=temp, k=k, p=p)[0]) for t in range(40)}
        assert draws <= allowed, (k, p, draws - allowed)


def test_positional_construction_keeps_its_order_and_the_new_fields_default_off():
    p = SamplingParams(0.5, 7, 0.9, 3)
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (0.5, 7, 0.9, 3)
    assert not p.penalised and not p.logprobs and p.top_logprobs == 0
    p.validate(vocab_size=10)


def test_logit_bias_is_taken_as_a_mapping_and_kept_hashable():
    p = SamplingParams(logit_bias={9: -1.0, 2: 5.0})
    assert p.logit_bias == ((2, 5.0), (9, -1.0)) and p.penalised
    assert hash(p) == hash(SamplingParams(logit_bias=[(9, -1.0), (2, 5.0)]))
    p.validate(vocab_size=10)
    for on in (dict(presence_penalty=0.1), dict(frequency_penalty=-0.1), dict(repetition_penalty=1.1)):
        assert SamplingParams(**on).penalised


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("bad, says", [
    (dict(presence_penalty=NAN), "presence_penalty"), (dict(presence_penalty=2.5), r"\[-2, 2\]"),
    (dict(frequency_penalty=-INF), "frequency_penalty"), (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(repetition_penalty=0.0), r"\(0, 2\]"), (dict(repetition_penalty=2.5), "repetition_penalty"),
    (dict(repetition_penalty=NAN), "repetition_penalty"), (dict(presence_penalty=True), "presence_penalty"),
    (dict(logit_bias={1: 101.0}), r"\[-100, 100\]"), (dict(logit_bias={1: NAN}), "token 1"),
    (dict(logit_bias={-1: 1.0}), "token id -1"), (dict(logit_bias={10: 1.0}), r"\[0, 10\)"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "at most 300"), (dict(logit_bias=((1, 1.0), (1, 2.0))), "twice"),
    (dict(logit_bias="x"), "pairs"), (dict(logit_bias={1.5: 1.0}), "token id 1.5"),
    (dict(logprobs=1), "logprobs must be"), (dict(logprobs=True, top_logprobs=21), r"\[0, 20\]"),
    (dict(logprobs=True, top_logprobs=-1), "top_logprobs"), (dict(top_logprobs=3), "needs logprobs"),
])
def test_bad_penalties_bias_and_logprobs_are_refused_in_one_sentence(bad, says):
    with pytest.raises(ValueError, match=says) as e:
        SamplingParams(**bad).validate(vocab_size=10)
    assert str(e.value).count(". ") == 0 and "\n" not in str(e.value)


def test_bias_ids_are_checked_against_the_vocabulary_only_where_it_is_known():
    p = SamplingParams(logit_bias={5000: 1.0})
    p.validate()  # the router without a vocabulary
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        p.validate(vocab_size=512)
    SamplingParams(logprobs=True, top_logprobs=20, logit_bias={i: 1.0 for i in range(300)}).validate(vocab_size=512)
