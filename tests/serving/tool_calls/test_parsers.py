"""Each family's parser: content and calls from a whole output, the same from its deltas at every split,
calls sent as OpenAI's tool_calls deltas, markers never leaking into content, malformed calls as content."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from serving.tool_calls import parsers
from serving.tool_calls.stream import Parsed, ToolCall, collect, openai_call_id


def counter():
    n = itertools.count()
    return lambda: f"id{next(n)}"


def whole(family, text, names=None) -> Parsed:
    return parsers.make(family, names, new_id=counter()).parse(text)


def streamed(family, pieces, names=None) -> tuple[Parsed, list[dict]]:
    stream = parsers.make(family, names, new_id=counter())
    deltas = []
    for piece in pieces:
        deltas += stream.feed(piece)
        stream.check_integrity()
    deltas += stream.finish()
    stream.check_integrity()
    return collect(deltas), deltas


def splits(text):
    """Two pieces at every boundary, one character at a time, and random pieces of 1 to 5."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)
    rng = random.Random(text)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)], strict=True)]


def call(name, args, i=0):
    return ToolCall(f"id{i}", name, json.dumps(args))


WEATHER = {"city": "Paris", "unit": "c"}
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
HERMES_2 = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
MISTRAL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]'

CASES = {  # family -> [(output, expected parse)]
    "hermes": [
        ("Just text, no call.", Parsed("Just text, no call.", [])),
        (HERMES, Parsed("", [call("get_weather", WEATHER)])),
        ("Let me look.\n" + HERMES + "\nDone.", Parsed("Let me look.\nDone.", [call("get_weather", WEATHER)])),
        (HERMES + "\n" + HERMES_2 + "\n", Parsed("", [call("get_weather", WEATHER), call("noop", {}, 1)])),
        ("a <tool_call> is a tag", Parsed("a <tool_call> is a tag", [])),  # not followed by {: text
        ('<tool_call>\n{"name": 1, "arguments": {}}\n</tool_call>x',
         Parsed('<tool_call>\n{"name": 1, "arguments": {}}\n</tool_call>x', [])),
        ('<tool_call>{"name": "a", "arguments": {}}', Parsed("", [call("a", {})])),  # ended right after the JSON
        ('<tool_call>{"name": "a", "argu', Parsed('<tool_call>{"name": "a", "argu', [])),  # cut inside
        ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', Parsed("", [call("a", {"x": 1})])),
        ("ends with <tool_ca", Parsed("ends with <tool_ca", [])),
    ],
    "llama3": [
        ("The weather is fine.", Parsed("The weather is fine.", [])),
        (LLAMA, Parsed("", [call("get_weather", WEATHER)])),
        ("<|python_tag|>" + LLAMA, Parsed("", [call("get_weather", WEATHER)])),
        (LLAMA + '; {"name": "noop", "parameters": {}}',
         Parsed("", [call("get_weather", WEATHER), call("noop", {}, 1)])),
        (LLAMA + "\nThat is all.", Parsed("That is all.", [call("get_weather", WEATHER)])),
        ('{"name": "get_weather"}', Parsed('{"name": "get_weather"}', [])),  # no parameters: all content
        ("  <|python_tag|>{oops}", Parsed("  <|python_tag|>{oops}", [])),
        ('{"name": "a", "parameters": {', Parsed('{"name": "a", "parameters": {', [])),
        ("Sure: " + LLAMA, Parsed("Sure: " + LLAMA, [])),  # calls only at the start
        ('{"name": "a", "parameters": {"s": "}{;"}}', Parsed("", [call("a", {"s": "}{;"})])),
    ],
    "mistral": [
        ("No tools needed.", Parsed("No tools needed.", [])),
        (MISTRAL, Parsed("", [call("get_weather", WEATHER)])),
        ("Checking. " + MISTRAL[:-1] + ', {"name": "noop", "arguments": {}}] ok',
         Parsed("Checking. ok", [call("get_weather", WEATHER), call("noop", {}, 1)])),
        ('[TOOL_CALLS] {"name": "noop", "arguments": {}}', Parsed("", [call("noop", {})])),
        ("[TOOL_CALLS] nothing", Parsed("[TOOL_CALLS] nothing", [])),
        ("[TOOL_CALLS][]", Parsed("[TOOL_CALLS][]", [])),
        ('[TOOL_CALLS][{"name": "a", "arguments": {}}, 3]',
         Parsed('[TOOL_CALLS][{"name": "a", "arguments": {}}, 3]', [])),
        ('[TOOL_CALLS][{"name": "a", "argu', Parsed('[TOOL_CALLS][{"name": "a", "argu', [])),
        ("cut [TOOL_CAL", Parsed("cut [TOOL_CAL", [])),
    ],
}
ALL = [(family, text, expected) for family, cases in CASES.items() for text, expected in cases]
MARKER = {"hermes": re.compile(r"<tool_"), "llama3": re.compile(r"<\|python"), "mistral": re.compile(r"\[TOOL_")}


@pytest.mark.parametrize("family,text,expected", ALL)
def test_whole_output(family, text, expected):
    assert whole(family, text) == expected


@pytest.mark.parametrize("family,text,expected", ALL)
def test_every_split_joins_to_the_whole_parse(family, text, expected):
    for pieces in splits(text):
        got, deltas = streamed(family, pieces)
        assert got == expected, pieces
        if expected.calls:  # a well-formed call's marker is never sent, not even in part
            assert not any(MARKER[family].search(d["content"]) for d in deltas if "content" in d), pieces


def test_deltas_are_openai_tool_call_chunks():
    got, deltas = streamed("hermes", ["Let me look.\n", HERMES[:20], HERMES[20:], "\n", HERMES_2])
    calls = [d for d in deltas if "tool_calls" in d]
    assert calls[0] == {"tool_calls": [{"index": 0, "id": "id0", "type": "function",
                                        "function": {"name": "get_weather", "arguments": ""}}]}
    assert calls[1] == {"tool_calls": [{"index": 0, "function": {"arguments": json.dumps(WEATHER)}}]}
    assert calls[2]["tool_calls"][0]["index"] == 1 and calls[2]["tool_calls"][0]["id"] == "id1"
    assert deltas[0] == {"content": "Let me look."}
    assert all(set(d) in ({"content"}, {"tool_calls"}) for d in deltas)


def test_content_streams_before_the_output_ends():
    stream = parsers.make("hermes")
    assert stream.feed("Hello wor") == [{"content": "Hello wor"}]
    assert stream.feed("ld <tool") == [{"content": "ld"}]  # " <tool" may open a call: held
    assert stream.feed("s are fun") == [{"content": " <tools are fun"}]
    assert stream.finish() == []


def test_a_call_to_a_function_not_in_the_request_is_content():
    assert whole("hermes", HERMES, names={"noop"}) == Parsed(HERMES, [])
    assert whole("hermes", HERMES, names={"get_weather"}).calls == [call("get_weather", WEATHER)]
    assert whole("llama3", LLAMA, names={"noop"}) == Parsed(LLAMA, [])
    assert whole("mistral", MISTRAL, names=set()) == Parsed(MISTRAL, [])


def test_ids():
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", openai_call_id())
    assert openai_call_id() != openai_call_id()
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", parsers.parse("hermes", HERMES).calls[0].id)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", parsers.parse("mistral", MISTRAL).calls[0].id)  # Mistral's templates


def test_a_finished_stream_takes_no_more_text_and_unknown_parsers_are_refused():
    stream = parsers.make("hermes")
    stream.finish()
    with pytest.raises(ValueError, match="finished"):
        stream.feed("more")
    with pytest.raises(ValueError, match="unknown tool-call parser 'xml'"):
        parsers.make("xml")
