"""The grammar for tool_choice "required" / a named function: llguidance compiles it, and a matcher over
the real SmolLM2 tokenizer accepts exactly the family's call syntax with arguments valid against the
tool's schema (one call when parallel_tool_calls is false or a function is named); what it accepts,
the family's parser reads back as those calls."""

from __future__ import annotations

import json

import pytest

from pddjax.model.meta import model_facts
from serving.tool_calls import parsers
from serving.tool_calls.grammar import call_grammar
from serving.tool_calls.validate import check_tools

UNIT = {"$ref": "#/$defs/Unit"}  # pydantic-style: resolved against the tool's own schema
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": UNIT}, "required": ["city", "unit"],
    "additionalProperties": False, "$defs": {"Unit": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "noop"}}]
WEATHER = {"city": "Paris", "unit": "c"}
REQUIRED, SINGLE, NOOP = ("required",), ("required", False), ({"type": "function", "function": {"name": "noop"}},)


def calls_text(family, calls):
    """`calls` [(name, args)] written as the grammar writes them."""
    key = "parameters" if family == "llama3" else "arguments"
    objs = [json.dumps({"name": n, key: a}) for n, a in calls]
    if family == "hermes":
        return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)
    if family == "llama3":
        return "; ".join(objs)
    return "[TOOL_CALLS][" + ", ".join(objs) + "]"


def grammar(family, choice, tools=TOOLS):
    kind, text = call_grammar(family, tools, check_tools(tools, *choice))
    assert kind == "lark"
    return text


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral"])
def test_the_grammars_shape(family):
    text = grammar(family, REQUIRED)
    assert text.count("%json {") == 2 and '"$ref": "#/$defs/Unit"' in text
    assert text.startswith("start: ") and "call" in text.splitlines()[0] and ")*" in text.splitlines()[0]
    assert ")*" not in grammar(family, SINGLE).splitlines()[0]
    assert grammar(family, NOOP).count("%json {") == 1
    assert call_grammar(family, TOOLS, check_tools(TOOLS, "auto")) is None
    assert call_grammar(family, TOOLS, check_tools(TOOLS, "none")) is None


def test_a_special_token_marker_is_written_as_that_token():
    text = call_grammar("mistral", TOOLS, check_tools(TOOLS, "required"), {"[TOOL_CALLS]": 5})[1]
    assert text.startswith('start: <[5]> "[" call')
    with pytest.raises(ValueError, match="no tool-call grammar for parser 'xml'"):
        call_grammar("xml", TOOLS, check_tools(TOOLS, "required"))


@pytest.fixture(scope="module")
def matcher_for(tmp_path_factory):
    llg = pytest.importorskip("llguidance")
    _, tok = model_facts("smollm2-135m")
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(tok.tok.to_str())
    lltok = llg.LLTokenizer(str(path))

    def accepts(family, choice, text, tools=TOOLS) -> bool:
        compiled = llg.LLMatcher.grammar_from_lark(grammar(family, choice, tools))
        assert llg.LLMatcher.validate_grammar(compiled, lltok) == ""
        matcher = llg.LLMatcher(lltok, compiled)
        ids = lltok.tokenize_str(text)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
    return accepts


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral"])
def test_the_grammar_accepts_calls_valid_against_the_schema(matcher_for, family):
    one = calls_text(family, [("get_weather", WEATHER)])
    two = calls_text(family, [("get_weather", WEATHER), ("noop", {})])
    assert matcher_for(family, REQUIRED, one) and matcher_for(family, REQUIRED, two)
    assert matcher_for(family, SINGLE, one) and not matcher_for(family, SINGLE, two)
    assert matcher_for(family, NOOP, calls_text(family, [("noop", {})])) and not matcher_for(family, NOOP, one)
    for args in ({"city": "Paris", "unit": "k"}, {"city": "Paris"}, {"city": 3, "unit": "c"},
                 {"city": "Paris", "unit": "c", "extra": 1}):
        assert not matcher_for(family, REQUIRED, calls_text(family, [("get_weather", args)])), args
    assert not matcher_for(family, REQUIRED, calls_text(family, [("get_time", {})]))
    assert not matcher_for(family, REQUIRED, calls_text(family, [("noop", {"x": 1})]))
    assert not matcher_for(family, REQUIRED, "I would rather not call anything.")
    assert not matcher_for(family, REQUIRED, one.replace('"Paris",', '"Paris",  '))  # compact JSON only
    got = parsers.parse(family, two, names={"get_weather", "noop"})
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", WEATHER), ("noop", {})]
    assert got.content == ""


@pytest.mark.parametrize("family", ["hermes", "llama3"])
def test_objects_that_leave_extra_keys_unstated_take_none_in_a_forced_call(matcher_for, family):
    """LangChain's and the Agents SDK's tools often omit additionalProperties; a forced call must
    still end when the stated keys are written, nested objects too (not when max_tokens cuts it)."""
    open_tool = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"},
                                         "opts": {"type": "object", "properties": {"round": {"type": "boolean"}}}},
        "required": ["a"]}}}]
    assert matcher_for(family, REQUIRED, calls_text(family, [("add", {"a": 1, "opts": {"round": True}})]), open_tool)
    for args in ({"a": 1, "b": 2}, {"a": 1, "opts": {"round": True, "mode": "up"}}):
        assert not matcher_for(family, REQUIRED, calls_text(family, [("add", args)]), open_tool), args
