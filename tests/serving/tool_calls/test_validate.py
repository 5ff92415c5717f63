"""A request's tools, tool_choice and tool messages: accepted as OpenAI defines them, refused with a
sentence naming the part otherwise."""

from __future__ import annotations

import pytest

from serving.tool_calls.validate import MAX_TOOLS, ToolChoice, check_messages, check_tools


def tool(name="get_weather", **fn):
    return {"type": "function", "function": {"name": name, **fn}}


WEATHER = tool(description="Weather in a city",
               parameters={"type": "object", "properties": {"city": {"type": "string"}}})


def test_tool_choices():
    assert check_tools([WEATHER]) == ToolChoice("auto", None, True)
    assert check_tools(None) == ToolChoice("none", None, True)
    assert check_tools([WEATHER], "required", False) == ToolChoice("required", None, False)
    assert check_tools([WEATHER, tool("noop")], {"type": "function", "function": {"name": "noop"}}) == \
        ToolChoice("function", "noop", True)
    assert check_tools(None, "auto").mode == "auto"


@pytest.mark.parametrize("tools,choice,parallel,part", [
    ([{"type": "code_interpreter"}], None, None, r"tools\[0\]\.type"),
    ([tool("has space")], None, None, r"tools\[0\]\.function\.name"),
    ([tool("x" * 65)], None, None, r"tools\[0\]\.function\.name"),
    ([tool(), tool()], None, None, r"tools\[1\]\.function\.name 'get_weather' is given twice"),
    ([tool(parameters={"type": "array"})], None, None, r"tools\[0\]\.function\.parameters"),
    ([tool(parameters=[1])], None, None, r"tools\[0\]\.function\.parameters"),
    ([tool(description=3)], None, None, r"tools\[0\]\.function\.description"),
    ([tool(strict="yes")], None, None, r"tools\[0\]\.function\.strict"),
    ([{"type": "function"}], None, None, r"tools\[0\]\.function must be an object"),
    ([tool(f"f{i}") for i in range(MAX_TOOLS + 1)], None, None, r"tools holds 129 tools"),
    ([tool(description="x" * 300_000)], None, None, r"tools is larger than"),
    ({"a": 1}, None, None, r"tools must be a list"),
    ([WEATHER], "always", None, r"tool_choice must be"),
    ([WEATHER], {"type": "function", "function": {"name": "other"}}, None, r"tool_choice\.function\.name 'other'"),
    ([WEATHER], {"type": "function"}, None, r"tool_choice must be"),
    (None, "required", None, r"tool_choice \"required\" needs tools"),
    ([WEATHER], None, "yes", r"parallel_tool_calls must be a boolean"),
])
def test_bad_tools_name_the_part(tools, choice, parallel, part):
    with pytest.raises(ValueError, match=part):
        check_tools(tools, choice, parallel)


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_tool_messages_answering_calls_are_accepted():
    check_messages([{"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
                    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]}])


@pytest.mark.parametrize("messages,part", [
    ([{"role": "tool", "content": "18C"}], r"messages\[0\]\.tool_call_id is required"),
    ([{"role": "tool", "tool_call_id": "call_9", "content": "18C"}], r"messages\[0\]\.tool_call_id 'call_9'"),
    ([{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1", "content": 5}],
     r"messages\[1\]\.content must be text"),
    ([{"role": "user", "tool_calls": [CALL]}], r"messages\[0\]\.tool_calls is only for assistant"),
    ([{"role": "assistant", "tool_calls": {"id": "x"}}], r"messages\[0\]\.tool_calls must be a list"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "id": ""}]}], r"messages\[0\]\.tool_calls\[0\]\.id"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]}], r"messages\[0\]\.tool_calls\[0\]\.type"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {"city": "P"}}}]}],
     r"messages\[0\]\.tool_calls\[0\]\.function\.arguments must be a JSON text"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]}],
     r"messages\[0\]\.tool_calls\[0\]\.function\.name"),
    (["hi"], r"messages\[0\] must be an object"),
])
def test_bad_tool_messages_name_the_part(messages, part):
    with pytest.raises(ValueError, match=part):
        check_messages(messages)
