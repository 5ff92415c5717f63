"""Penalties, logit bias and logprobs in the step's sampler, against plain numpy on random logits."""

import jax
import numpy as np
import pytest

from pddjax.model import penalties
from pddjax.model.penalties import Tables
from pddjax.model.sampling import TOP_LOGPROBS, sample_step

V = 300
rng = np.random.default_rng(0)


def np_penalise(logits, prompt, generated, presence, frequency, repetition, bias):
    """One row as the spec says: repetition (HF, prompt + output), then frequency / presence
    (OpenAI, output only), then the bias."""
    x = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(generated, int), minlength=V)
    hit = np.zeros(V, bool)
    hit[list(prompt)] = True
    hit |= counts > 0
    x[hit] = np.where(x[hit] > 0, x[hit] / repetition, x[hit] * repetition)
    x -= frequency * counts + presence * (counts > 0)
    for t, b in bias:
        x[t] += b
    return x


def np_log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


ROWS = [  # (prompt, generated, presence, frequency, repetition, bias)
    (rng.integers(0, V, 40), rng.integers(0, 20, 30), 0.7, 0.4, 1.0, ()),
    (rng.integers(0, V, 300), rng.integers(0, V, 5), 0.0, 0.0, 1.6, ()),
    (rng.integers(0, V, 9), [], -0.5, 0.0, 0.7, ((5, 30.0), (17, -100.0), (299, 2.5))),
    (rng.integers(0, V, 600), rng.integers(0, 12, 270), 1.5, 2.0, 1.3, ((3, -7.0),)),  # > one seed chunk
]


def seeded_tables(rows, chunk=256) -> Tables:
    """Tables whose row i is seeded from ROWS[i] through `seed_row`, `chunk` ids per call."""
    tables = Tables.zeros(len(rows) + 2, V)
    for i, (prompt, gen, *_, r, bias) in enumerate(rows):
        ids, vals = np.full(penalties.NUM_BIAS, -1, np.int32), np.zeros(penalties.NUM_BIAS, np.float32)
        ids[:len(bias)], vals[:len(bias)] = [t for t, _ in bias], [b for _, b in bias]
        prompt = list(prompt) if r != 1.0 else []
        for c in range(0, max(len(prompt), len(gen), 1), chunk):
            p, g = np.full(chunk, -1, np.int32), np.full(chunk, -1, np.int32)
            p[:len(prompt[c:c + chunk])], g[:len(gen[c:c + chunk])] = prompt[c:c + chunk], gen[c:c + chunk]
            tables = penalties.seed_row_jit(tables, np.int32(i), p, g, ids, vals, np.asarray(c == 0))
    return tables


def step_sampling(B, pen_row, rows, want=None, temperature=0.0):
    f = np.zeros(B, np.float32)
    presence, frequency, repetition = f.copy(), f.copy(), np.ones(B, np.float32)
    for b, c in enumerate(pen_row):
        if c >= 0:
            presence[b], frequency[b], repetition[b] = rows[c][2:5]
    want = np.zeros(B, bool) if want is None else np.asarray(want)
    return (np.zeros(B, np.int32), np.zeros(B, np.int32), np.full(B, temperature, np.float32), np.zeros(B, np.int32),
            np.ones(B, np.float32), np.asarray(pen_row, np.int32), presence, frequency, repetition, want)


step_jit = jax.jit(sample_step)


def test_apply_matches_numpy():
    logits = (rng.standard_normal((len(ROWS), V)) * 4).astype(np.float32)
    counts = np.stack([np.bincount(np.asarray(g, int), minlength=V) for _, g, *_ in ROWS]).astype(np.int32)
    seen = np.zeros((len(ROWS), V), bool)
    bias = np.zeros((len(ROWS), V), np.float32)
    for i, (p, _, _, _, _, b) in enumerate(ROWS):
        seen[i, p] = True
        for t, v in b:
            bias[i, t] = v
    scal = [np.array([r[k] for r in ROWS], np.float32) for k in (2, 3, 4)]
    got = np.asarray(jax.jit(penalties.apply)(logits, counts, seen, bias, *scal))
    for i, row in enumerate(ROWS):
        np.testing.assert_allclose(got[i], np_penalise(logits[i], *row[:2], *row[2:5], row[5]), rtol=1e-6, atol=1e-5)
        assert np.abs(got[i] - logits[i]).max() > 0.1  # every row is changed


def test_rows_seeded_from_token_ids_penalise_like_numpy_and_plain_rows_stay_raw():
    tables = seeded_tables(ROWS)
    pen_row = [2, -1, 0, 3, -1, 1]  # step rows in another order than table rows; two plain rows
    B = len(pen_row)
    logits = (rng.standard_normal((B, V)) * 4).astype(np.float32)
    tokens, (chosen, top_ids, top_vals), after = step_jit(logits, tables, step_sampling(B, pen_row, ROWS, [1] * B),
                                                          np.asarray(True))
    lp = np_log_softmax(logits)  # of the RAW logits
    for b, c in enumerate(pen_row):
        want = np_penalise(logits[b], *ROWS[c][:2], *ROWS[c][2:5], ROWS[c][5]) if c >= 0 else logits[b]
        assert tokens[b] == np.argmax(want), b
        np.testing.assert_allclose(chosen[b], lp[b, tokens[b]], atol=1e-5)
        np.testing.assert_array_equal(top_ids[b], np.argsort(-lp[b], kind="stable")[:TOP_LOGPROBS])
        np.testing.assert_allclose(top_vals[b], np.sort(lp[b])[::-1][:TOP_LOGPROBS], atol=1e-5)
    # the bias of +30 on token 5 (table row 2) forces it
    assert tokens[0] == 5
    # the step counted each penalised row's sampled token in its table row, nothing for plain rows
    diff = np.asarray(after.counts) - np.asarray(tables.counts)
    assert diff.sum() == sum(c >= 0 for c in pen_row)
    for b, c in enumerate(pen_row):
        if c >= 0:
            assert diff[c, tokens[b]] == 1


def test_no_row_asks_nothing_changes():
    tables = seeded_tables(ROWS)
    B = 4
    logits = (rng.standard_normal((B, V)) * 4).astype(np.float32)
    tokens, lp, after = step_jit(logits, tables, step_sampling(B, [-1] * B, ROWS), np.asarray(True))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    assert not np.asarray(lp[0]).any() and not np.asarray(lp[1]).any()
    np.testing.assert_array_equal(after.counts, tables.counts)
    tokens, _, none = step_jit(logits, None, step_sampling(B, [0] * B, ROWS), np.asarray(True))  # no tables
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    assert none is None


def test_sampled_rows_draw_from_the_penalised_distribution():
    """temperature 1: the draw follows softmax(penalised logits); a -100 bias is never drawn."""
    rows = [(np.arange(0), [], 0.0, 0.0, 1.0, ((0, -100.0),)), (np.arange(0), [1, 1, 1], 0.0, 2.0, 1.0, ())]
    tables = seeded_tables(rows)
    logits = np.zeros((2, V), np.float32)
    logits[:, :2] = 8.0  # tokens 0 and 1 dominate before the penalties
    hits = np.zeros((2, V))
    for t in range(60):
        sp = list(step_sampling(2, [0, 1], rows, temperature=1.0))
        sp[0], sp[1] = np.full(2, 3, np.int32), np.full(2, t, np.int32)
        tokens, _, _ = step_jit(logits, tables, tuple(sp), np.asarray(False))
        hits[[0, 1], np.asarray(tokens)] += 1
    assert hits[0, 0] == 0 and hits[0, 1] > 45  # biased away: token 1 takes its mass (unbiased: ~half each)
    assert hits[1, 1] < 5 and hits[1, 0] > 45  # token 1 penalised by 6: token 0 takes its mass


def test_a_reset_seed_clears_the_row_and_an_incremental_one_adds():
    tables = seeded_tables(ROWS)
    empty = np.full(256, -1, np.int32)
    ids, vals = np.full(penalties.NUM_BIAS, -1, np.int32), np.zeros(penalties.NUM_BIAS, np.float32)
    gen = empty.copy()
    gen[:3] = [7, 7, 9]
    t2 = penalties.seed_row_jit(tables, np.int32(0), empty, gen, ids, vals, np.asarray(True))
    want = np.zeros(V, np.int32)
    want[7], want[9] = 2, 1
    np.testing.assert_array_equal(np.asarray(t2.counts)[0], want)
    assert not np.asarray(t2.seen)[0].any() and (np.asarray(t2.bias_ids)[0] == -1).all()
    t3 = penalties.seed_row_jit(t2, np.int32(0), empty, gen, ids, vals, np.asarray(False))
    np.testing.assert_array_equal(np.asarray(t3.counts)[0], 2 * want)


@pytest.mark.parametrize("n", [0, 5])
def test_logprobs_match_numpy(n):
    from pddjax.model.sampling import logprobs

    logits = (rng.standard_normal((3, V)) * 5).astype(np.float32)
    tokens = np.array([4, 100, 299], np.int32)
    chosen, ids, vals = jax.jit(logprobs)(logits, tokens)
    lp = np_log_softmax(logits)
    np.testing.assert_allclose(chosen, lp[np.arange(3), tokens], atol=1e-5)
    np.testing.assert_array_equal(ids[:, :n], np.argsort(-lp, axis=-1, kind="stable")[:, :n])
