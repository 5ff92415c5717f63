"""Llama 3.1+ JSON tool calls: the output is `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`.

An output is read as calls when, after leading whitespace, it starts with `<|python_tag|>` or
`{`; otherwise all of it is content. Calls are JSON objects with a string `name` (one of the
request's, when given) and an object `parameters` (or `arguments`), one after another, separated
by `;` and / or whitespace (how vLLM reads several).

Malformed calls fall back to content:
- the first object is not a well-formed call, or the output ends inside it: the whole output is
  content, exactly as written (marker and leading whitespace included);
- after one or more calls, anything that is not a separator or a well-formed call: from there on
  all is content (the calls before it stand; the whitespace before it is dropped).
Streaming holds everything until the first call is read (only then is it known to be one); after
that, content passes as it comes.
"""

from __future__ import annotations

from serving.tool_calls.stream import CallStream, JsonScanner, loads

PYTHON_TAG = "<|python_tag|>"
_START, _CALLS, _OBJECT, _CONTENT = "start", "calls", "object", "content"


class Llama3Stream(CallStream):
    arguments_keys = ("parameters", "arguments")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.state = _START
        self.raw = ""  # everything fed until the first call (the fallback's content)
        self.buf = ""  # text not yet read
        self.scanner: JsonScanner | None = None
        self.object = ""  # the object being read

    def _step(self, text: str) -> None:
        if self.calls == 0:
            self.raw += text
        if self.state == _CONTENT:
            self._content(text)
            return
        self.buf += text
        while self.buf and self._read():
            pass

    def _read(self) -> bool:
        """Read on from `buf`; False when more text is needed."""
        if self.state == _START:
            head = self.buf.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return False
            self.state = _CALLS
            self.buf = head[len(PYTHON_TAG):] if head.startswith(PYTHON_TAG) else head
            return True
        if self.state == _CALLS:
            self.buf = self.buf.lstrip()
            if self.calls and self.buf.startswith(";"):
                self.buf = self.buf[1:]
                return True
            if not self.buf:
                return False
            if self.buf[0] != "{":
                self._give_up(self.buf)
                return False
            self.state, self.scanner, self.object = _OBJECT, JsonScanner(), ""
        n = self.scanner.feed(self.buf)
        if n is None:
            self.object, self.buf = self.object + self.buf, ""
            return False
        self.object, self.buf = self.object + self.buf[:n], self.buf[n:]
        call = self._read_call(loads(self.object))
        if call is None:
            self._give_up(self.object + self.buf)
            return False
        self._call(*call)
        self.raw, self.state = "", _CALLS
        return True

    def _give_up(self, rest: str) -> None:
        """Content from here on: the whole output when no call was read, else `rest`."""
        self._content(self.raw if self.calls == 0 else rest)
        self.state, self.buf, self.raw = _CONTENT, "", ""

    def _end(self) -> None:
        if self.state == _START:
            self._content(self.buf)
        elif self.state == _OBJECT:
            self._give_up(self.object)
        self.buf = ""

    def check_integrity(self) -> None:
        super().check_integrity()
        assert self.state in (_START, _CALLS, _OBJECT, _CONTENT), f"unknown state {self.state!r}"
        assert self.calls == 0 or not self.raw, "the fallback text is kept after a call was read"
        assert (self.scanner is not None) or self.state != _OBJECT, "reading an object without a scanner"
