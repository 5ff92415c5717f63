"""What every tool-call parser shares: the call record, OpenAI's `delta` pieces, call ids, a JSON scanner.

A parser is a `CallStream`: fed an output's text deltas (`feed`), then told it ended (`finish`),
it returns OpenAI chat-completion `delta` pieces, each one of

- `{"content": "..."}`: text outside calls (consecutive pieces of one `feed` are merged);
- `{"tool_calls": [{"index": i, "id": "call_...", "type": "function", "function": {"name": n, "arguments": ""}}]}`:
  a call's head, always first for its index;
- `{"tool_calls": [{"index": i, "function": {"arguments": "..."}}]}`: its arguments (a JSON text).

A call's head and arguments go out together once the whole call was read and checked, so a call
that turns out malformed was never sent and can still fall back to content: the joined deltas of
any split of a text equal `parse(text)` (which is `feed(text)` + `finish()`). `collect` joins them.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Iterable
from typing import NamedTuple

ALNUM = string.ascii_letters + string.digits


def openai_call_id() -> str:
    """An id the way OpenAI writes them: `call_` and 24 random letters or digits."""
    return "call_" + "".join(secrets.choice(ALNUM) for _ in range(24))


class ToolCall(NamedTuple):
    id: str  # "call_..." (a Mistral parser's: 9 letters or digits)
    name: str  # the function's name
    arguments: str  # a JSON object's text


class Parsed(NamedTuple):
    content: str  # the text outside calls ("" when there is none)
    calls: list[ToolCall]  # in output order


def collect(deltas: Iterable[dict]) -> Parsed:
    """The content and calls that a sequence of delta pieces spells."""
    content, calls = [], {}
    for d in deltas:
        if "content" in d:
            content.append(d["content"])
        for piece in d.get("tool_calls", ()):
            call = calls.setdefault(piece["index"], {"id": None, "name": None, "arguments": []})
            if "id" in piece:
                call["id"], call["name"] = piece["id"], piece["function"]["name"]
            call["arguments"].append(piece["function"].get("arguments", ""))
    return Parsed("".join(content), [ToolCall(c["id"], c["name"], "".join(c["arguments"]))
                                     for _, c in sorted(calls.items())])


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (text that may begin it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class JsonScanner:
    """Finds where one JSON object or array ends, in text fed piece by piece (strings and escapes respected).

    Fed text must start with `{` or `[`; brackets are counted, not matched (a mismatch closes the
    value early and json.loads then refuses it)."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """How many characters of `text` complete the value, or None when all of it was read and it is open."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return None


class CallStream:
    """One output's streaming parse (subclasses: `_step` reads the pending text, `_end` what is left).

    names: the request's function names; a call to any other name is malformed (None: any name).
    new_id: the id maker (tests pass a counter)."""

    arguments_keys = ("arguments",)  # where a call's JSON holds its arguments, first match wins

    def __init__(self, names: Iterable[str] | None = None, new_id: Callable[[], str] = openai_call_id):
        self.names = frozenset(names) if names is not None else None
        self.new_id = new_id
        self.calls = 0  # calls sent so far (the next call's index)
        self.ended = False
        self._out: list[dict] = []

    def feed(self, text: str) -> list[dict]:
        if self.ended:
            raise ValueError("this tool-call stream has finished: it takes no more text")
        if text:
            self._step(text)
        return self._take()

    def finish(self) -> list[dict]:
        if not self.ended:
            self.ended = True
            self._end()
        return self._take()

    def parse(self, text: str) -> Parsed:
        """The whole output at once (a fresh stream only)."""
        return collect(self.feed(text) + self.finish())

    def check_integrity(self) -> None:
        ids = [p for d in self._out for p in d.get("tool_calls", ())]
        assert all(p["index"] < self.calls for p in ids), "a delta names a call index not yet given"

    def _step(self, text: str) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        raise NotImplementedError

    def _take(self) -> list[dict]:
        out, self._out = self._out, []
        return out

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._out and "content" in self._out[-1]:
            self._out[-1] = {"content": self._out[-1]["content"] + text}
        else:
            self._out.append({"content": text})

    def _call(self, name: str, arguments: str) -> None:
        i, self.calls = self.calls, self.calls + 1
        head = {"index": i, "id": self.new_id(), "type": "function", "function": {"name": name, "arguments": ""}}
        self._out.append({"tool_calls": [head]})
        self._out.append({"tool_calls": [{"index": i, "function": {"arguments": arguments}}]})

    def _read_call(self, value) -> tuple[str, str] | None:
        """(name, arguments JSON) of a decoded call object, or None when it is not a well-formed call:
        a JSON object with a string `name` (one of `names`) and an object under an `arguments_keys` key
        (or a string holding one)."""
        if not isinstance(value, dict):
            return None
        name = value.get("name")
        if not isinstance(name, str) or not name or (self.names is not None and name not in self.names):
            return None
        key = next((k for k in self.arguments_keys if k in value), None)
        if key is None:
            return None
        args = value[key]
        if isinstance(args, str):
            args = loads(args)
        if not isinstance(args, dict):
            return None
        return name, json.dumps(args, ensure_ascii=False)


def loads(text: str):
    """json.loads, or None when `text` is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None
