"""Hermes-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Qwen2 / Qwen2.5 / Qwen3, SmolLM2 (through the Hermes preamble, `pddjax.model.chat_template`), Hermes.

Content around calls: `marked.py`. Malformed calls fall back to content, as the model wrote them:
- `<tool_call>` followed by anything but `{` (after whitespace): the marker is content and reading
  goes on right after it;
- a body up to `</tool_call>` that is not one JSON object with a string `name` (one of the
  request's, when given) and an object `arguments` (or `parameters`, or a string holding an
  object): marker, body and closing marker are content;
- an output that ends inside a call (no `</tool_call>`): a call when its body is well-formed (the
  model stopped right after the JSON), else content.
A body cannot hold the text `</tool_call>` (the first one closes it). Where a tokenizer makes the
markers special tokens, decode with special tokens kept.
"""

from __future__ import annotations

from serving.tool_calls.marked import MarkedStream
from serving.tool_calls.stream import loads

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesStream(MarkedStream):
    marker = OPEN
    arguments_keys = ("arguments", "parameters")

    def _opened(self) -> None:
        self.searched = 0  # how far `buf` holds no closing marker

    def _read_inside(self) -> bool:
        head = self.buf.lstrip()
        if head and head[0] != "{":  # not a call: the marker was text
            self._malformed("")
            return True
        j = self.buf.find(CLOSE, self.searched)
        if j < 0:
            self.searched = max(0, len(self.buf) - len(CLOSE) + 1)
            return False
        body, self.buf = self.buf[:j], self.buf[j + len(CLOSE):]
        call = self._read_call(loads(body))
        if call is None:
            self._malformed(body + CLOSE)
        else:
            self._called([call])
        return True

    def _end_inside(self) -> None:
        call = self._read_call(loads(self.buf))
        if call is None:
            self._malformed(self.buf)
        else:
            self._called([call])
