"""Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (a JSON array after the marker).

Content around calls: `marked.py`. A single object after the marker is read as a one-call array.
Ids are 9 letters or digits, not OpenAI's `call_...`: Mistral's chat templates refuse any other
tool_call_id when the calls come back in the next turn (vLLM makes them the same way). The
marker is a special token in Mistral's tokenizers: decode with special tokens kept.

Malformed calls fall back to content, as the model wrote them:
- the marker followed by anything but `[` or `{` (after whitespace): the marker is content and
  reading goes on right after it;
- an array that is empty or not all well-formed calls (a string `name`, one of the request's when
  given, and an object `arguments`): marker and array are content;
- an output that ends inside the array: the marker and the text after it are content.
"""

from __future__ import annotations

import secrets

from serving.tool_calls.marked import MarkedStream
from serving.tool_calls.stream import ALNUM, JsonScanner, loads

MARKER = "[TOOL_CALLS]"


def mistral_call_id() -> str:
    return "".join(secrets.choice(ALNUM) for _ in range(9))


class MistralStream(MarkedStream):
    marker = MARKER

    def __init__(self, names=None, new_id=mistral_call_id):
        super().__init__(names, new_id)

    def _opened(self) -> None:
        self.array = ""  # the value's text read so far (from the marker on)
        self.scanner: JsonScanner | None = None

    def _read_inside(self) -> bool:
        if self.scanner is None:
            head = self.buf.lstrip()
            if not head:
                return False
            if head[0] not in "[{":
                self._malformed("")
                return True
            self.array, self.buf, self.scanner = self.buf[:len(self.buf) - len(head)], head, JsonScanner()
        n = self.scanner.feed(self.buf)
        if n is None:
            self.array, self.buf = self.array + self.buf, ""
            return False
        self.array, self.buf = self.array + self.buf[:n], self.buf[n:]
        value = loads(self.array)
        calls = [self._read_call(v) for v in (value if isinstance(value, list) else [value])]
        if not calls or None in calls:
            self._malformed(self.array)
        else:
            self._called(calls)
        return True

    def _end_inside(self) -> None:
        self._malformed(self.array + self.buf)
