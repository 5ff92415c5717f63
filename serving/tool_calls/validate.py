"""Checks on a chat request's tools: `tools`, `tool_choice`, `parallel_tool_calls` and the tool messages.

Bodies are plain JSON values (dicts, lists; a pydantic model's `model_dump()`). Each refusal is a
ValueError with one sentence naming the part (`tools[2].function.name`), for a 400.

- `tools`: at most MAX_TOOLS, at most MAX_TOOLS_BYTES of JSON in all; each `{"type": "function",
  "function": {"name", "description"?, "parameters"?, "strict"?}}`, the name matching NAME and not
  given twice, `parameters` a JSON-schema object (`type` "object" when given);
- `tool_choice`: "none", "auto", "required" or `{"type": "function", "function": {"name"}}` naming
  one of the tools ("required" and a named function need tools);
- `parallel_tool_calls`: a boolean;
- messages: an assistant's `tool_calls` are `{"id", "type": "function", "function": {"name",
  "arguments"}}` (arguments a JSON text); a "tool" message has a `tool_call_id` naming a call of an
  earlier assistant message, and text content.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

MAX_TOOLS = 128
MAX_TOOLS_BYTES = 256 * 1024
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")


class ToolChoice(NamedTuple):
    mode: str  # "none" | "auto" | "required" | "function"
    name: str | None  # the named function (mode "function")
    parallel: bool  # more than one call allowed (parallel_tool_calls, default true)


def _function(i: int, tool) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ValueError(f"{where}.type must be \"function\" (the only kind of tool served)")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ValueError(f"{where}.function must be an object with a name")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}")
    if not isinstance(fn.get("description", ""), str | type(None)):
        raise ValueError(f"{where}.function.description must be a string")
    params = fn.get("parameters")
    if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
        raise ValueError(f"{where}.function.parameters must be a JSON schema of an object")
    if not isinstance(fn.get("strict", False), bool | type(None)):
        raise ValueError(f"{where}.function.strict must be a boolean")
    return fn


def check_tools(tools, tool_choice=None, parallel_tool_calls=None) -> ToolChoice:
    """The request's tool settings checked; the mode its output is read (and constrained) in."""
    tools = tools or []
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of function tools")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools holds {len(tools)} tools, more than the {MAX_TOOLS} allowed")
    if len(json.dumps(tools, ensure_ascii=False).encode()) > MAX_TOOLS_BYTES:
        raise ValueError(f"tools is larger than {MAX_TOOLS_BYTES} bytes of JSON")
    names = set()
    for i, tool in enumerate(tools):
        name = _function(i, tool)["name"]
        if name in names:
            raise ValueError(f"tools[{i}].function.name {name!r} is given twice")
        names.add(name)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError("parallel_tool_calls must be a boolean")
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none", None, parallel)
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ValueError(f"tool_choice must be none, auto, required or a named function, got {tool_choice!r}")
        if tool_choice == "required" and not tools:
            raise ValueError("tool_choice \"required\" needs tools")
        return ToolChoice(tool_choice, None, parallel)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(fn, dict):
        raise ValueError('tool_choice must be none, auto, required or {"type": "function", "function": {"name"}}')
    if fn.get("name") not in names:
        raise ValueError(f"tool_choice.function.name {fn.get('name')!r} is not one of the tools")
    return ToolChoice("function", fn["name"], parallel)


def _tool_call(where: str, call) -> str:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise ValueError(f"{where}.type must be \"function\"")
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise ValueError(f"{where}.id must be a non-empty string")
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}.function.name must be a non-empty string")
    if not isinstance(fn.get("arguments"), str):
        raise ValueError(f"{where}.function.arguments must be a JSON text (a string)")
    return call["id"]


def _is_text(content) -> bool:
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content)


def check_messages(messages) -> None:
    """An assistant's `tool_calls` and the "tool" messages answering them, checked."""
    if not isinstance(messages, list):
        raise ValueError("messages must be a list")
    called: set[str] = set()
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object")
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant":
                raise ValueError(f"messages[{i}].tool_calls is only for assistant messages")
            if not isinstance(calls, list):
                raise ValueError(f"messages[{i}].tool_calls must be a list")
            called.update(_tool_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(calls))
        if m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"messages[{i}].tool_call_id is required for a tool message")
            if call_id not in called:
                raise ValueError(f"messages[{i}].tool_call_id {call_id!r} answers no earlier assistant tool call")
            if not _is_text(m.get("content")):
                raise ValueError(f"messages[{i}].content must be text (a string or text parts)")
