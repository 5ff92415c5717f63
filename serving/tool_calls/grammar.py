"""The grammar that forces a tool call: `tool_choice` "required" or a named function, in the family's syntax.

`call_grammar` returns `("lark", text)` in llguidance's Lark dialect (the caller makes it the
engine's grammar spec), or None when nothing is forced ("none", "auto"). The call's frame is Lark
text, each function's arguments an inline `%json { parameters }` rule of its own, so a schema's
`$ref`s resolve against its own root and the arguments validate against the tool's `parameters`
(a tool without `parameters` takes `{}`; objects that do not say otherwise take no keys beyond
their `properties`, `_closed`). The JSON is written compactly the way the families'
templates write calls (`", "` and `": "`, no other whitespace), which also keeps a weak model from
padding it with whitespace.

- "required": one or more calls of any of the tools (exactly one when parallel_tool_calls is false);
- a named function: exactly one call, of that function.
Per family (what its parser reads, `parsers.py`):
- hermes: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, calls one per line;
- llama3: `{"name": "f", "parameters": {...}}`, calls separated by `"; "`;
- mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`.
special_ids: a tokenizer's special-token text -> id; a marker that is a special token there is
written as that token (`<[id]>`), since a string literal cannot match a special token.
"""

from __future__ import annotations

import json

from serving.tool_calls.validate import ToolChoice

# the compact JSON of the families' templates (json.dumps' defaults)
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# family -> (before the calls, between calls, after the calls, before each call, after each call, arguments key)
FRAMES = {
    "hermes": ("", "\n", "", "<tool_call>\n", "\n</tool_call>", "arguments"),
    "llama3": ("", "; ", "", "", "", "parameters"),
    "mistral": ("[TOOL_CALLS][", ", ", "]", "", "", "arguments"),
}
MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]")


def _literal(text: str, special_ids: dict[str, int]) -> str:
    """Lark for the exact `text`, its markers as special tokens where `special_ids` has them ("" -> "")."""
    parts, pos = [], 0
    while pos < len(text):
        hits = [(text.find(m, pos), m) for m in MARKERS if m in special_ids and text.find(m, pos) >= 0]
        at, marker = min(hits) if hits else (len(text), None)
        if at > pos:
            parts.append(json.dumps(text[pos:at]))
        if marker is None:
            break
        parts.append(f"<[{special_ids[marker]}]>")
        pos = at + len(marker)
    return " ".join(parts)


def _closed(schema):
    """`schema` with every object that lists `properties` and says nothing of
    `additionalProperties` closed to them (`additionalProperties: false`), through nested
    properties, items, combinators and definitions (not inside `not`, where closing would widen
    what the schema accepts): a forced call of a weak model can otherwise
    invent keys until max_tokens ends it (xgrammar's strict mode, vLLM's and SGLang's default, does
    the same)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties"):
            out[key] = {k: _closed(v) for k, v in value.items()} if isinstance(value, dict) else value
        elif key in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties"):
            out[key] = _closed(value)
        else:
            out[key] = value
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _arguments_schema(fn: dict) -> dict:
    params = _closed(fn.get("parameters") or NO_PARAMETERS)
    return {**params, "x-guidance": JSON_STYLE}


def call_grammar(family: str, tools: list[dict], choice: ToolChoice,
                 special_ids: dict[str, int] | None = None) -> tuple[str, str] | None:
    """("lark", grammar) forcing `choice`'s calls in `family`'s syntax, or None (module docstring).

    tools: the request's checked tools (`validate.check_tools`)."""
    if family not in FRAMES:
        raise ValueError(f"no tool-call grammar for parser {family!r}: use one of {', '.join(sorted(FRAMES))}")
    if choice.mode in ("none", "auto"):
        return None
    special_ids = special_ids or {}
    fns = [t["function"] for t in tools]
    if choice.mode == "function":
        fns = [f for f in fns if f["name"] == choice.name]
    if not fns:
        raise ValueError("tool_choice names no function among the tools")
    before, between, after, open_, close, key = FRAMES[family]
    lit = lambda text: _literal(text, special_ids)  # noqa: E731
    seq = lambda *parts: " ".join(p for p in parts if p)  # noqa: E731
    many = choice.mode == "required" and choice.parallel
    calls = seq("call", f"({seq(lit(between), 'call')})*") if many else "call"
    lines = [f"start: {seq(lit(before), calls, lit(after))}",
             f"call: {seq(lit(open_), 'fn', lit(close))}",
             "fn: " + " | ".join(f"fn_{i}" for i in range(len(fns)))]
    for i, fn in enumerate(fns):
        head = json.dumps({"name": fn["name"]})[:-1] + ", " + json.dumps(key) + ": "  # {"name": "f", "arguments":
        lines.append(f"fn_{i}: {seq(lit(head), f'args_{i}', lit('}'))}")
        lines.append(f"args_{i}: %json {json.dumps(_arguments_schema(fn), ensure_ascii=False)}")
    return "lark", "\n".join(lines) + "\n"
