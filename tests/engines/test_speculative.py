"""Speculative decoding (engines/speculate.py): drafted decode rows verified in the step give
plain decoding's tokens exactly, greedy and seeded, with drafts accepted and rejected; rejected
drafts' KV rolled back; no step shape outside the stated set."""

import pytest

from pddjax.engines import speculate
from pddjax.engines.drafter import Drafter
from pddjax.engines.paged_engine import EngineConfig, PagedEngine
from pddjax.engines.step import compile_count
from pddjax.model.sampling_params import SamplingParams
from tests.support.samples import prompt, repetitive

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11)
COOL = SamplingParams(temperature=0.2, top_k=40, top_p=0.95, seed=11)  # peaked enough that drafts pass
HOT = SamplingParams(temperature=1.5, seed=3)
NO_STOP = ()


def engine(tiny, speculative="ngram", **kw):
    # test_penalties' and test_grammar_engine's table: their step programs serve here too
    cfg = dict(page_size=8, num_pages=256, max_step_tokens=64, max_rows=16, speculative=speculative,
               spec_max_tokens=4)
    cfg.update(kw)
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, EngineConfig(**cfg))
    eng.step_costs = None  # every draft verified: these tests are about verification, not its economics
    return eng


def drain(eng, check=True):
    out = {}
    while eng.has_work():
        for ev in eng.step():
            seq = out.setdefault(ev.seq_id, [])
            assert ev.position == len(seq), "events out of order"
            seq.append(ev.token)
        if check:
            eng.check_integrity()
    return out


def generate(eng, prompts, params, max_tokens, stop_ids=NO_STOP):
    for name, p in prompts.items():
        eng.add(name, p, params, max_tokens, stop_ids)
    return drain(eng)


PROMPTS = {"rep": repetitive(40, 1), "rep2": repetitive(23, 2), "plain": prompt(17, 3), "short": prompt(3, 4)}


@pytest.mark.parametrize("params", [GREEDY, COOL, HOT], ids=["greedy", "cool", "hot"])
def test_speculation_gives_plain_decodings_tokens(tiny, ref, params, monkeypatch):
    """Sampled rows too: the draw at each position is plain decoding's (seed, position) draw.
    Hot rows' random outputs repeat no 2-gram, so there the drafter matches single tokens too
    (min_ngram 1): its drafts are then verified and mostly rejected by the sampled rule."""
    if params is HOT:
        monkeypatch.setattr(speculate, "new_drafter", lambda seq, k: Drafter(seq.all_tokens(), k, min_ngram=1))
    spec = engine(tiny)
    got = generate(spec, PROMPTS, params, 40)
    for name, p in PROMPTS.items():
        assert got[name] == ref.generate(p, params, 40, NO_STOP).token_ids, name
    assert spec.spec_drafted > 0
    if params is HOT:  # near-uniform over the tiny model's vocabulary: drafts are rejected
        return
    assert spec.spec_accepted > 0, "no draft was accepted: the test does not exercise acceptance"
    assert spec.spec_drafted > spec.spec_accepted, "no draft was rejected: the test does not exercise rollback"
    assert spec.num_pages_active == 0
    spec.check_integrity()


def test_fewer_steps_when_drafts_are_accepted(tiny):
    plain, spec = engine(tiny, speculative="off"), engine(tiny)
    a = generate(plain, {"r": repetitive(40, 1)}, GREEDY, 40)
    b = generate(spec, {"r": repetitive(40, 1)}, GREEDY, 40)
    assert a == b
    assert spec.num_steps < plain.num_steps


def test_stop_tokens_and_max_tokens_cut_an_accepted_run(tiny, ref):
    p = repetitive(40, 1)
    eng, runs = engine(tiny), []  # runs: the output positions each step recorded
    eng.add("r", p, GREEDY, 40, NO_STOP)
    out = []
    while eng.has_work():
        events = eng.step()
        runs.append([e.position for e in events])
        out += [e.token for e in events]
    inside = [r[i] for r in runs for i in range(len(r) - 1)]  # positions inside an accepted run
    assert inside, "no accepted run to cut"
    for cut in inside[:3]:
        eng = engine(tiny)
        got = generate(eng, {"r": p}, GREEDY, cut + 1)
        assert got["r"] == ref.generate(p, GREEDY, cut + 1, NO_STOP).token_ids == out[:cut + 1]
        assert eng.num_pages_active == 0
    # a stop token inside a run of accepted drafts ends it there (the tiny model's loops repeat
    # every token they accept, so the run is made by hand)
    eng = engine(tiny)
    seq = eng.add("s", p, GREEDY, 40, stop_ids=(7,))
    eng.step()  # the prompt: one token
    start, seq.drafter = seq.pages.num_tokens, speculate.new_drafter(seq, 4)
    events, accepted = speculate.accept(seq, [5, 7, 9], [5, 7, 9, 11])
    assert [(e.token, e.finish_reason) for e in events] == [(5, None), (7, "stop")]
    assert accepted == 1 and seq.pages.num_tokens == start + 2 and seq.generated[1:] == [5, 7]


def test_rollback_keeps_kv_and_cache_to_accepted_tokens(tiny, ref):
    eng = engine(tiny, page_size=4)
    p = repetitive(30, 5)
    eng.add("r", p, GREEDY, 30, NO_STOP)
    eng.seqs["r"].hold_on_finish = True
    while eng.seqs["r"].num_pending:
        eng.step()
        seq = eng.seqs["r"]
        assert seq.pages.num_tokens == seq.num_tokens - 1  # KV for every accepted token but the last sample
        eng.check_integrity()
    assert eng.spec_drafted > eng.spec_accepted > 0
    eng.release("r")
    eng.check_integrity()
    # the prefix cache holds exactly the accepted context: a second run hits it and agrees
    expected = ref.generate(p, GREEDY, 30, NO_STOP).token_ids
    full = p + expected[:-1]
    assert eng.prefix_hit(full) == (len(full) // 4) * 4
    again = generate(engine(tiny), {"r": p}, GREEDY, 30)
    assert again["r"] == expected


def test_opted_out_and_unsupported_rows_never_draft(tiny):
    eng = engine(tiny)
    for name, params in {"out": SamplingParams(speculative=False), "lp": SamplingParams(logprobs=True),
                         "pen": SamplingParams(presence_penalty=0.5)}.items():
        eng.add(name, repetitive(30, 1), params, 20, NO_STOP)
        assert not eng.seqs[name].speculates
    drain(eng)
    assert all(s.drafter is None for s in eng.seqs.values())
    assert eng.spec_drafted == 0


def test_verification_adds_no_compile(tiny):
    eng = engine(tiny)
    generate(eng, {"w": repetitive(40, 1), "x": prompt(12, 9)}, GREEDY, 30)
    n = compile_count()
    generate(eng, {f"r{i}": repetitive(30 + i, 10 + i) for i in range(4)}, GREEDY, 30)
    generate(eng, {f"s{i}": repetitive(25 + i, 20 + i) for i in range(4)}, SEEDED, 30)
    assert eng.spec_accepted > 0
    assert compile_count() == n
    for shape in [eng.last_shape[:4]]:
        assert shape in eng.stated


def test_bad_settings_are_refused():
    assert "speculative" in EngineConfig(speculative="eagle").check()
    assert "spec_max_tokens" in EngineConfig(spec_max_tokens=0).check()
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="yes").validate()
