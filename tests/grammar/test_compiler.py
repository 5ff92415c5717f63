"""The compiler refuses what llguidance refuses with a ValueError naming the part, compiles each
(tokenizer, spec) once into a bounded process-wide cache, refuses a compile past its time bound,
and can compile on a worker thread for the engine thread to use."""

import threading

import pytest

from pddjax.grammar import compiler as comp
from pddjax.grammar.spec import GrammarSpec
from tests.grammar.tiny_vocab import compiler, grammar_tokenizer


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec.json_schema({"not": {"type": "string"}}), r"json_schema is not supported: Unimplemented keys"),
    (GrammarSpec.json_schema({"type": "string", "format": "weird"}), "json_schema is not supported: Unknown format"),
    (GrammarSpec.json_schema({"$ref": "#/nope"}), "json_schema is not supported: Pointer '/nope' does not exist"),
    (GrammarSpec.regex("a[b"), "regex is not supported: .*unclosed character class"),
    (GrammarSpec.lark("start: foo"), 'lark is not supported: .*unknown name: "foo"'),
    (GrammarSpec("json_schema", "[]"), "json_schema must be a JSON object"),
])
def test_what_llguidance_refuses_is_a_value_error_naming_the_part(spec, words):
    with pytest.raises(ValueError, match=words):
        compiler().compile(spec)


def test_each_spec_compiles_once_and_the_cache_is_bounded(monkeypatch):
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"once": {"type": "integer"}}})
    before = comp.cache().builds
    first = compiler().compile(spec)
    assert compiler().compile(GrammarSpec.json_schema(spec.text)) is first  # another compiler, the same key
    assert comp.cache().builds == before + 1
    small = comp._Cache(2)
    monkeypatch.setattr(comp, "_cache", small)
    for i in range(4):
        compiler().compile(GrammarSpec.regex(f"x{i}+"))
    assert len(small) == 2 and small.builds == 4
    small.check_integrity()
    compiler().compile(GrammarSpec.regex("x0+"))  # evicted: built again
    assert small.builds == 5


def test_a_compile_past_the_time_bound_is_refused(monkeypatch):
    monkeypatch.setattr(comp, "_cache", comp._Cache(4))
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"[a-z]{{{i},{i + 40}}}x"}
                                            for i in range(200)}}
    with pytest.raises(ValueError, match="json_schema grammar is too large: it did not compile within 1e-06 s"):
        compiler(timeout_s=1e-6).compile(GrammarSpec.json_schema(big))


def test_twenty_properties_compile_in_well_under_50_ms():
    schema = {"type": "object", "properties": {f"p{i}": {"type": ["string", "integer", "boolean"][i % 3]}
                                               for i in range(20)}, "required": [f"p{i}" for i in range(20)]}
    c = compiler().compile(GrammarSpec.json_schema(schema))
    assert c.seconds < 0.05, c.seconds


def test_a_worker_thread_compiles_and_the_caller_finds_it_cached():
    spec = GrammarSpec.regex("(yes|no)[.!]")
    done = []
    t = threading.Thread(target=lambda: done.append(compiler().compile(spec)))
    t.start()
    t.join(10)
    before = comp.cache().builds
    m = compiler().matcher(spec)
    assert comp.cache().builds == before and done[0].spec == spec
    m.advance(grammar_tokenizer().encode("no!"))
    assert m.is_finished()
