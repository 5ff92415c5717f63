"""Penalties, logit_bias and logprobs in the paged engine equal the reference engine's, token for
token and logprob for logprob (1e-5), mixed in one batch with plain rows, across the RLD -> MD
switch (a fresh engine admits the prompt and the tokens generated so far), after a rollback and
an evicted penalty row, with no compile after warm-up."""

import numpy as np
import pytest

from pddjax.engines.paged_engine import EngineConfig, PagedEngine
from pddjax.engines.penalty_state import PenaltyRows
from pddjax.model.penalties import Tables
from pddjax.model.sampling_params import SamplingParams
from tests.support.samples import prompt

NO_STOP = ()
N = 16
# (The random tiny model seldom repeats a token: a negative presence penalty makes it repeat, the
# frequency penalty then stops each repeat after a while; both decide tokens from position 10 on.)
CASES = {
    "plain-greedy": SamplingParams(),
    "plain-seeded": SamplingParams(0.9, 40, 0.95, 11),
    "pf-greedy": SamplingParams(presence_penalty=-1.5, frequency_penalty=0.7),
    "pf-seeded": SamplingParams(0.9, 40, 0.95, 12, presence_penalty=-2.0, frequency_penalty=1.0),
    "rep-greedy": SamplingParams(repetition_penalty=1.8),
    "rep-seeded": SamplingParams(1.0, 0, 1.0, 5, repetition_penalty=1.5),
    "bias-forced": SamplingParams(logit_bias={42: 100.0}),
    "lp-greedy": SamplingParams(logprobs=True, top_logprobs=5),
    "lp-seeded-pen": SamplingParams(0.8, 0, 1.0, 3, presence_penalty=0.5, repetition_penalty=1.2, logprobs=True,
                                    top_logprobs=5),
}
PROMPTS = {name: prompt(20, 202) if name.startswith("pf") else prompt(20, 210) if name.startswith("rep") else
           prompt(6 + 7 * i, 200 + i) for i, name in enumerate(CASES)}


def engine(tiny, **kw):
    cfg = dict(page_size=8, num_pages=256, max_step_tokens=64, max_rows=16)
    cfg.update(kw)
    return PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, EngineConfig(**cfg))


@pytest.fixture(scope="module")
def expected(ref):
    return {name: ref.generate(PROMPTS[name], params, N, NO_STOP) for name, params in CASES.items()}


def events_of(eng, rows=None) -> dict:
    """Every TokenEvent by sequence, stepping until no work is left; `rows` (a list) gets each step's rows."""
    out = {}
    while eng.has_work():
        for ev in eng.step():
            out.setdefault(ev.seq_id, []).append(ev)
        eng.check_integrity()
        if rows is not None:
            rows.append(eng.last_shape[4])
    return out


def assert_logprobs(got, want, name):
    assert len(got) == len(want), name
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None and abs(g.logprob - w.logprob) < 1e-5, (name, i, g, w)
        assert [t for t, _ in g.top] == [t for t, _ in w.top] and len(g.top) == 5, (name, i)
        np.testing.assert_allclose([v for _, v in g.top], [v for _, v in w.top], atol=1e-5)


def test_the_reference_applies_them(ref, expected):
    """(What the engine tests below would not see if both engines ignored the parameters.)"""
    tok = {k: r.token_ids for k, r in expected.items()}
    assert tok["bias-forced"] == [42] * N
    for name in ("pf-greedy", "rep-greedy"):  # not the plain greedy answer to the same prompt
        plain = ref.generate(PROMPTS[name], SamplingParams(), N, NO_STOP).token_ids
        assert tok[name] != plain, name
    lp = expected["lp-greedy"].logprobs
    assert lp[0].top[0][0] == tok["lp-greedy"][0] and all(v <= 0 for _, v in lp[0].top)


def test_a_mixed_batch_equals_the_reference(tiny, expected):
    eng = engine(tiny)
    for name, params in CASES.items():
        eng.add(name, PROMPTS[name], params, N, NO_STOP)
    rows = []
    got = events_of(eng, rows)
    assert max(rows) == len(CASES)  # every case in one step
    for name, params in CASES.items():
        assert [ev.token for ev in got[name]] == expected[name].token_ids, name
        if params.logprobs:
            assert_logprobs([ev.logprobs for ev in got[name]], expected[name].logprobs, name)
        else:
            assert all(ev.logprobs is None for ev in got[name])
    assert not any(eng.penalties.owner) and eng.num_pages_active == 0


def argmax_changed_at(ref, name) -> int:
    """An output position >= 3 whose greedy token is not the raw logits' argmax: the penalty state
    of the tokens before it decides it."""
    params = CASES[name]
    for t, (tok, logits) in enumerate(ref.stream(PROMPTS[name], params, N, NO_STOP, return_logits=True)):
        if t >= 3 and tok != int(np.argmax(logits)):
            return t
    raise AssertionError(f"{name}: the penalty never changes the argmax")


@pytest.mark.parametrize("name", ["pf-greedy", "pf-seeded", "rep-greedy", "lp-seeded-pen"])
def test_the_switch_rebuilds_the_state_from_token_ids(tiny, ref, expected, name):
    """Engine A (RLD) generates k tokens; a fresh engine B (MD, another page size) admits the
    prompt's KV and those k ids and continues: A's tokens + B's equal the reference's. Greedy:
    k is a position where the penalty changes the argmax."""
    params, p = CASES[name], PROMPTS[name]
    k = argmax_changed_at(ref, name) if params.temperature <= 0 else 5
    a = engine(tiny)
    a.add("r", p, params, N, NO_STOP, hold_on_finish=True)
    a_events = []
    while len(a.seqs["r"].generated) < k:
        a_events += a.step()
    handed, kv = a.seqs["r"].generated[:k], a.export_kv("r", 0, len(p))
    b = engine(tiny, page_size=16)
    b.add("r", p, params, N, NO_STOP)
    b.import_kv("r", kv)
    b.append_tokens("r", 0, handed)
    b_events = events_of(b)["r"]
    assert b_events[0].position == k
    assert handed + [ev.token for ev in b_events] == expected[name].token_ids
    if params.logprobs:
        assert_logprobs([ev.logprobs for ev in a_events[:k] + b_events], expected[name].logprobs, name)


def test_a_rollback_below_the_counted_tokens_reseeds(tiny, ref, expected):
    """MD sampled ahead, then RLD's tokens disagree from position j on (serving/engine/handoff.py
    rolls back and appends them): the row is rebuilt, tokens stay the reference's."""
    name = "pf-greedy"
    p, want = PROMPTS[name], expected[name].token_ids
    k = argmax_changed_at(ref, name)
    b = engine(tiny)
    b.add("r", p, CASES[name], N, NO_STOP)
    while len(b.seqs["r"].generated) < k + 2:
        b.step()
    seq = b.seqs["r"]
    seq.rollback(k - 2)
    assert seq.pen_counted == -1
    seq.append_known(k - 2, want[k - 2:k])
    out = seq.generated[:k] + [ev.token for ev in events_of(b)["r"]]
    assert out == want


def test_an_evicted_row_is_rebuilt_when_its_sequence_samples_again(tiny, expected):
    """Two table rows for three penalised sequences: a paused one loses its row to a newcomer and
    is reseeded from its tokens when it comes back."""
    eng = engine(tiny)
    eng.penalties = PenaltyRows(Tables.zeros(2, tiny.config.vocab_size))
    names = ["pf-greedy", "rep-seeded", "pf-seeded"]
    got = {n: [] for n in names}

    def step():
        for ev in eng.step():
            got[ev.seq_id].append(ev.token)
        eng.check_integrity()

    for n in names[:2]:
        eng.add(n, PROMPTS[n], CASES[n], N, NO_STOP)
    for _ in range(4):
        step()
    eng.seqs["pf-greedy"].paused = True
    eng.add("pf-seeded", PROMPTS["pf-seeded"], CASES["pf-seeded"], N, NO_STOP)
    for _ in range(3):
        step()
    assert eng.seqs["pf-greedy"].pen_row == -1  # evicted
    eng.seqs["pf-greedy"].paused = False
    while eng.has_work():
        step()
    for n in names:
        assert got[n] == expected[n].token_ids, n


def test_more_penalised_sequences_than_rows_wait_their_turn(tiny, expected):
    eng = engine(tiny)
    eng.penalties = PenaltyRows(Tables.zeros(1, tiny.config.vocab_size))
    names = ["pf-greedy", "rep-greedy", "plain-greedy", "bias-forced"]
    for n in names:
        eng.add(n, PROMPTS[n], CASES[n], N, NO_STOP)
    got = events_of(eng)
    for n in names:
        assert [ev.token for ev in got[n]] == expected[n].token_ids, n


def test_penalties_need_known_bias_ids(tiny):
    eng = engine(tiny)
    with pytest.raises(ValueError, match=r"logit_bias token id 512 .*\[0, 512\)"):
        eng.add("r", prompt(5), SamplingParams(logit_bias={512: 1.0}), 4, NO_STOP)
    assert not eng.seqs
