"""A GrammarSpec is frozen and hashable, its schema kept as canonical JSON in the schema's own key
order, and bad specs are refused with a ValueError naming the part (no llguidance needed)."""

import json

import pytest

from pddjax.grammar.spec import MAX_TEXT_BYTES, GrammarSpec
from pddjax.model.sampling_params import SamplingParams


def test_the_same_schema_written_two_ways_is_one_spec():
    a = GrammarSpec.json_schema({"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}})
    b = GrammarSpec.json_schema('{ "type" : "object", "properties": {"b": {"type":"integer"}, "a": {}} }')
    assert a == b and hash(a) == hash(b) and a.key == b.key
    assert list(json.loads(a.text)["properties"]) == ["b", "a"]  # the output's key order is the schema's
    assert GrammarSpec.regex("a+").key != GrammarSpec.lark("a+").key
    assert hash(SamplingParams(grammar=a)) == hash(SamplingParams(grammar=b))


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("yaml", "x"), "grammar kind must be one of"),
    (GrammarSpec("regex", 5), "text must be a string"),
    (GrammarSpec("regex", ""), "regex grammar is empty"),
    (GrammarSpec("lark", "  "), "lark grammar is empty"),
    (GrammarSpec("json_object", "{}"), "json_object grammar takes no text"),
    (GrammarSpec("json_schema", "{not json"), "json_schema is not valid JSON"),
    (GrammarSpec("json_schema", "[1, 2]"), "json_schema must be a JSON object"),
    (GrammarSpec("lark", "x" * (MAX_TEXT_BYTES + 1)), "lark grammar is too large"),
])
def test_bad_specs_are_refused_naming_the_part(spec, words):
    with pytest.raises(ValueError, match=words):
        spec.validate()
    with pytest.raises(ValueError, match=words):
        SamplingParams(grammar=spec).validate()


def test_good_specs_pass_and_a_non_spec_grammar_is_refused():
    for spec in (GrammarSpec.json_object(), GrammarSpec.json_schema({"type": "string"}), GrammarSpec.regex("[0-9]+"),
                 GrammarSpec.lark('start: "a"')):
        SamplingParams(grammar=spec).validate()
    with pytest.raises(ValueError, match="grammar must be a GrammarSpec"):
        SamplingParams(grammar='{"type": "object"}').validate()
    with pytest.raises(ValueError, match="json_schema is not JSON"):
        GrammarSpec.json_schema({"x": object()})
