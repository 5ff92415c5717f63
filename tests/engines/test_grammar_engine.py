"""Constrained decoding in the paged engine equals the reference engine token for token (greedy
and seeded; json_schema, regex and Lark; mixed in one batch with unconstrained rows), its
outputs are what the grammar allows even from the random tiny model, and the grammar's state
survives the RLD -> MD switch: a fresh engine admits the prompt's KV and the tokens so far, its
matcher advanced through them, and continues as the reference does."""

import json
import re

import pytest

from pddjax.engines.paged_engine import EngineConfig, PagedEngine
from pddjax.engines.reference import ReferenceEngine
from pddjax.grammar.spec import GrammarSpec
from pddjax.model.sampling_params import SamplingParams
from tests.grammar.tiny_vocab import EOS, compiler, grammar_tokenizer
from tests.support.samples import prompt

NO_STOP = ()
N = 40
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 999},
                                           "tag": {"enum": ["red", "green"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
REGEX = r"[a-d]{2,6}-[0-9]{1,3}"
LARK = 'start: "(" item (", " item)* ")"\nitem: /[xyz]{1,3}/'
SPECS = {"json": GrammarSpec.json_schema(SCHEMA), "regex": GrammarSpec.regex(REGEX), "lark": GrammarSpec.lark(LARK)}
CASES = {f"{k}-{mode}": SamplingParams(grammar=s) if mode == "greedy" else
         SamplingParams(0.9, 0, 1.0, 11 + i, grammar=s)
         for i, (k, s) in enumerate(SPECS.items()) for mode in ("greedy", "seeded")}
PROMPTS = {name: prompt(5 + 3 * i, 300 + i) for i, name in enumerate(CASES)}


def engine(tiny, **kw):
    cfg = dict(page_size=8, num_pages=256, max_step_tokens=64, max_rows=16)
    cfg.update(kw)
    return PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, EngineConfig(**cfg), grammar=compiler())


@pytest.fixture(scope="module")
def gref(tiny):
    return ReferenceEngine(tiny.config, tiny.weights, grammar=compiler())


@pytest.fixture(scope="module")
def want(gref):
    return {name: gref.generate(PROMPTS[name], params, N, NO_STOP) for name, params in CASES.items()}


def run(eng) -> dict:
    out = {}
    while eng.has_work():
        for ev in eng.step():
            out.setdefault(ev.seq_id, []).append(ev)
        eng.check_integrity()
    return out


def text(ids) -> str:
    return grammar_tokenizer().token_bytes(ids).decode()


def test_a_mixed_batch_equals_the_reference(tiny, ref, want):
    eng = engine(tiny)
    for name, params in CASES.items():
        eng.add(name, PROMPTS[name], params, N, NO_STOP)
    plain = {f"plain-{i}": (prompt(9 + i, 400 + i), SamplingParams() if i % 2 else SamplingParams(0.8, 0, 0.9, i))
             for i in range(4)}
    for name, (p, params) in plain.items():
        eng.add(name, p, params, 12, NO_STOP)
    out = run(eng)
    for name in CASES:
        assert [ev.token for ev in out[name]] == want[name].token_ids, name
        assert out[name][-1].finish_reason == want[name].finish_reason == "stop", name
    for name, (p, params) in plain.items():
        assert [ev.token for ev in out[name]] == ref.generate(p, params, 12, NO_STOP).token_ids, name


def test_the_random_model_says_only_what_the_grammar_allows(ref, want):
    for name, res in want.items():
        ids = res.token_ids[:-1] if res.token_ids[-1] == EOS else res.token_ids
        s = text(ids)
        if name.startswith("json"):
            value = json.loads(s)
            assert set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool), s
            assert 0 <= value["n"] <= 999 and value["tag"] in ("red", "green"), s
        elif name.startswith("regex"):
            assert re.fullmatch(REGEX, s), s
        else:
            assert re.fullmatch(r"\([xyz]{1,3}(, [xyz]{1,3})*\)", s), s
    plain = ref.generate(PROMPTS["json-greedy"], SamplingParams(), N, NO_STOP).token_ids
    with pytest.raises(ValueError):  # unconstrained, the same model writes no JSON
        json.loads(grammar_tokenizer().token_bytes(plain).decode(errors="replace"))


@pytest.mark.parametrize("name", list(CASES))
def test_the_switch_inside_the_grammar_continues_as_the_reference(tiny, want, name):
    """Engine A (RLD) samples k tokens (k inside a JSON value / the regex / a Lark item); a fresh
    engine B (MD, another page size) admits the prompt's KV and those k ids, its matcher advanced
    through them, and continues: A's tokens + B's equal the reference's."""
    params, p, expect = CASES[name], PROMPTS[name], want[name].token_ids
    k = len(expect) // 2
    a = engine(tiny)
    a.add("r", p, params, N, NO_STOP, hold_on_finish=True)
    while len(a.seqs["r"].generated) < k:
        a.step()
    handed, kv = a.seqs["r"].generated[:k], a.export_kv("r", 0, len(p))
    b = engine(tiny, page_size=16)
    b.add("r", p, params, N, NO_STOP)
    b.import_kv("r", kv)
    b.append_tokens("r", 0, handed)
    assert b.seqs["r"].matcher.consumed == k
    b.check_integrity()
    got = run(b)["r"]
    assert got[0].position == k and handed + [ev.token for ev in got] == expect
    assert got[-1].finish_reason == "stop"


def test_a_rollback_rewinds_the_grammar(tiny, want):
    """MD sampled ahead, then RLD's tokens (here the same ones) are appended from j on after a
    rollback: the matcher rewinds with the sequence and the tokens stay the reference's."""
    name = "json-seeded"
    expect = want[name].token_ids
    b = engine(tiny)
    b.add("r", PROMPTS[name], CASES[name], N, NO_STOP)
    while len(b.seqs["r"].generated) < 12:
        b.step()
    seq = b.seqs["r"]
    seq.rollback(6)
    assert seq.matcher.consumed == 6
    seq.append_known(6, expect[6:10])
    b.check_integrity()
    assert seq.generated[:10] + [ev.token for ev in run(b)["r"]] == expect


def test_handed_tokens_the_grammar_refuses_are_refused_whole(tiny):
    b = engine(tiny)
    b.add("r", PROMPTS["json-greedy"], CASES["json-greedy"], N, NO_STOP)
    ok = grammar_tokenizer().encode('{"ok": ')
    bad = ok + grammar_tokenizer().encode("maybe")
    with pytest.raises(ValueError, match=f"at output position {len(ok)} is not allowed by the request's json_schema"):
        b.append_tokens("r", 0, bad)
    assert b.seqs["r"].generated == [] and b.seqs["r"].matcher.consumed == 0
    b.append_tokens("r", 0, ok)
    b.check_integrity()


def test_a_complete_grammar_stops_the_row_without_eos(tiny, gref):
    params = SamplingParams(grammar=GrammarSpec.regex("[a-d]{3}"))
    eng = engine(tiny)
    eng.add("r", prompt(7, 5), params, N, NO_STOP)
    out = run(eng)["r"]
    ids = [ev.token for ev in out]
    assert len(ids) == 3 and EOS not in ids and out[-1].finish_reason == "stop"
    assert re.fullmatch("[a-d]{3}", text(ids)) and gref.generate(prompt(7, 5), params, N, NO_STOP).token_ids == ids


def test_constrained_requests_need_a_compiler_and_a_grammar_llguidance_takes(tiny):
    bare = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, EngineConfig(page_size=8, num_pages=64))
    with pytest.raises(ValueError, match="constrained decoding needs the model's tokenizer"):
        bare.add("r", prompt(5), CASES["regex-greedy"], 8)
    with pytest.raises(ValueError, match="regex is not supported"):
        engine(tiny).add("r", prompt(5), SamplingParams(grammar=GrammarSpec.regex("(")), 8)
    assert not bare.seqs
