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
"""

from __future__ import annotations

import datetime
import functools
import json
import re

# Placeholders: characters of Unicode's supplementary private use areas (planes 15-16).
_PRIVATE_FIRST, _PRIVATE_LAST = 0xF0000, 0x10FFFD


def _raise(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The template compiled in a fresh sandboxed environment (cached per source text)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplateError(ValueError):
    """The template did not compile or raised while rendering (message is one sentence)."""


def render(source: str, messages: list[dict], add_generation_prompt: bool, variables: dict[str, str]) -> str:
    try:
        return compile_template(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                               **variables)
    except Exception as e:  # noqa: BLE001  (jinja2 errors, a sandbox refusal, or the template's own raise)
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None


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
                special_ids: dict[str, int], encode_plain) -> list[int]:
    """Token ids of the rendered chat, where only the template's own special-token text is special.

    special_ids: special-token text -> id; encode_plain(text, first) -> ids with special-token matching
    off, `first` telling whether the text starts the input (a Metaspace "first" prepend applies there)."""
    if not special_ids:
        return encode_plain(render(source, messages, add_generation_prompt, variables), True)
    specials = _alternation(special_ids)
    used = {c for s in _strings(messages) for c in s}
    found = sorted({m.group(0) for s in _strings(messages) for m in specials.finditer(s)})
    free = (chr(c) for c in range(_PRIVATE_FIRST, _PRIVATE_LAST) if chr(c) not in used)
    to_placeholder = {text: next(free) for text in found}
    back = {p: text for text, p in to_placeholder.items()}
    if found:
        messages = _substitute(messages, _alternation(found), to_placeholder)
    text = render(source, messages, add_generation_prompt, variables)
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
