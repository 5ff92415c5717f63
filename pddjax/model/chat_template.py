"""Chat templates: rendered in jinja2's sandbox, and tokenized so users cannot forge special tokens.

Rendering follows transformers' `apply_chat_template`: an ImmutableSandboxedEnvironment (a
template cannot reach Python internals or mutate its inputs) with trim_blocks and lstrip_blocks,
the loopcontrols extension, `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII.

Tokenizing the rendered text as a whole would turn special-token text typed *inside* a message
(a user writing "<|im_end|>\\n<|im_start|>system") into real control tokens. `encode_chat` renders
the messages with every special-token string in them replaced by a private-use placeholder
character, so the only special-token text left in the render is the template's own. That text
is split out and mapped to its ids; everything between is tokenized with special-token matching
off (`tokenizers`' encode_special_tokens), after the placeholders are put back, so a user's
"<|im_end|>" comes out as the plain-text pieces it spells. That is how `tokenizers` itself
handles text between added tokens (each piece normalized and pre-tokenized alone), except a
Metaspace pre-tokenizer's prepend_scheme "first", which only the input's first piece gets: the
caller tokenizes later pieces with "never" there. Not reproduced: special tokens declared with
lstrip / rstrip (they swallow the whitespace beside them in `tokenizers`; none of the supported
families' templates use such tokens). Messages without special-token text
tokenize exactly as the plain render would (tests compare both on every fixture).

Tools follow transformers' convention: `tools` (a list of `{"type": "function", "function":
{...}}`) is the template's `tools` variable, assistant messages may carry `tool_calls`
(`[{"id", "type": "function", "function": {"name", "arguments"}}]`, an `arguments` JSON text
handed to the template as the object it spells, as transformers expects) and `role: "tool"`
messages the results. Where the template does not read them (`features`), they are rendered in
Hermes form, Qwen2.5's wording (a plain ChatML template such as SmolLM2's):
- `tools` unread: a system preamble (`HERMES_TOOLS`: "# Tools ... <tools>" one JSON per line
  "</tools>" and the `<tool_call>` instruction), after the first system message's text and a blank
  line, or as a new first system message;
- `tool_calls` unread: each call as `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`
  on its own line after the assistant turn's text;
- the role "tool" unread: a run of tool messages as one user turn of
  `<tool_response>\n...\n</tool_response>` blocks, one per line.
In `encode_chat` these markers are the template's own text, and the tools' strings the users'.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from typing import NamedTuple

# Placeholders: characters of Unicode's supplementary private use areas (planes 15-16).
_PRIVATE_FIRST, _PRIVATE_LAST = 0xF0000, 0x10FFFD


def _raise(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The template compiled in a fresh sandboxed environment (cached per source text)."""
    return _environment().from_string(source)


class Features(NamedTuple):
    tools: bool  # reads the `tools` variable
    tool_calls: bool  # reads a message's `tool_calls`
    tool_role: bool  # names the role "tool"


@functools.lru_cache(maxsize=16)
def features(source: str) -> Features:
    """What of the tools convention the template reads, from its syntax tree (a template that does
    not parse reads nothing; rendering it then fails with the parse error)."""
    import jinja2.meta
    from jinja2 import nodes

    try:
        tree = _environment().parse(source)
    except Exception:  # noqa: BLE001  (a syntax error: render() reports it)
        return Features(False, False, False)
    consts = {n.value for n in tree.find_all(nodes.Const) if isinstance(n.value, str)}
    attrs = {n.attr for n in tree.find_all(nodes.Getattr)}
    return Features(tools="tools" in jinja2.meta.find_undeclared_variables(tree),
                    tool_calls="tool_calls" in attrs | consts, tool_role="tool" in consts)


HERMES_TOOLS = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                "<tools>{tools}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
                "\"arguments\": <args-json-object>}}\n</tool_call>")


def _text(content) -> str:
    """A message's content as text: a string, nothing (""), or text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, list | tuple):
        return "\n".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return str(content)


def _arguments_object(call: dict) -> dict:
    """A tool call with its `arguments` JSON text decoded when it spells an object (transformers' form)."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


def with_tools(source: str, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) as the template is given them: arguments decoded, and what it does not
    read written into the messages in Hermes form (module docstring)."""
    feats = features(source)
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [_arguments_object(c) for c in m["tool_calls"]]
            if feats.tool_calls:
                m = {**m, "tool_calls": calls}
            else:
                blocks = ["<tool_call>\n" + json.dumps({"name": c.get("function", {}).get("name"),
                                                         "arguments": c.get("function", {}).get("arguments")},
                                                        ensure_ascii=False) + "\n</tool_call>" for c in calls]
                text = _text(m.get("content"))
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                m["content"] = "\n".join(([text] if text else []) + blocks)
        if m.get("role") == "tool" and not feats.tool_role:
            block = "<tool_response>\n" + _text(m.get("content")) + "\n</tool_response>"
            if out and out[-1].get("_tool_responses"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "_tool_responses": True})
            continue
        out.append(m)
    out = [{k: v for k, v in m.items() if k != "_tool_responses"} for m in out]
    if tools and not feats.tools:
        preamble = HERMES_TOOLS.format(tools="".join("\n" + _tojson(t) for t in tools))
        if out and out[0].get("role") == "system":
            first = _text(out[0].get("content"))
            out[0] = {**out[0], "content": (first + "\n\n" if first else "") + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out, tools


class ChatTemplateError(ValueError):
    """The template did not compile or raised while rendering (message is one sentence)."""


def _render(source: str, messages: list[dict], add_generation_prompt: bool, variables: dict[str, str],
            tools: list[dict] | None) -> str:
    try:
        return compile_template(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                               tools=tools, **variables)
    except Exception as e:  # noqa: BLE001  (jinja2 errors, a sandbox refusal, or the template's own raise)
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None


def render(source: str, messages: list[dict], add_generation_prompt: bool, variables: dict[str, str],
           tools: list[dict] | None = None) -> str:
    """The chat as text; `tools` and tool messages as the module docstring says (None: no tools, as
    transformers passes)."""
    messages, tools = with_tools(source, messages, tools)
    return _render(source, messages, add_generation_prompt, variables, tools)


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _substitute(value, pattern: re.Pattern, table: dict[str, str]):
    """`value` (nested dicts / lists / strings) with every match of `pattern` replaced via `table`."""
    if isinstance(value, str):
        return pattern.sub(lambda m: table[m.group(0)], value)
    if isinstance(value, dict):
        return {k: _substitute(v, pattern, table) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_substitute(v, pattern, table) for v in value]
    return value


def _alternation(texts) -> re.Pattern:
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def encode_chat(source: str, messages: list[dict], add_generation_prompt: bool, variables: dict[str, str],
                special_ids: dict[str, int], encode_plain, tools: list[dict] | None = None) -> list[int]:
    """Token ids of the rendered chat, where only the template's own special-token text is special.

    special_ids: special-token text -> id; encode_plain(text, first) -> ids with special-token matching
    off, `first` telling whether the text starts the input (a Metaspace "first" prepend applies there);
    tools: as `render`'s (their strings are the users', like the messages')."""
    if not special_ids:
        return encode_plain(render(source, messages, add_generation_prompt, variables, tools), True)
    specials = _alternation(special_ids)
    users = (messages, tools)
    used = {c for s in _strings(users) for c in s}
    found = sorted({m.group(0) for s in _strings(users) for m in specials.finditer(s)})
    free = (chr(c) for c in range(_PRIVATE_FIRST, _PRIVATE_LAST) if chr(c) not in used)
    to_placeholder = {text: next(free) for text in found}
    back = {p: text for text, p in to_placeholder.items()}
    if found:
        messages, tools = _substitute(list(users), _alternation(found), to_placeholder)
    messages, tools = with_tools(source, messages, tools)
    text = _render(source, messages, add_generation_prompt, variables, tools)
    restore = (lambda s: _substitute(s, _alternation(back), back)) if back else (lambda s: s)
    ids, pos = [], 0
    for m in specials.finditer(text):  # only the template's: the users' are placeholders here
        if m.start() > pos:
            ids += encode_plain(restore(text[pos:m.start()]), pos == 0)
        ids.append(special_ids[m.group(0)])
        pos = m.end()
    if pos < len(text):
        ids += encode_plain(restore(text[pos:]), pos == 0)
    return ids
