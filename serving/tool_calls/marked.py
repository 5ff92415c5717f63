"""The outside of calls that open with a marker (Hermes' `<tool_call>`, Mistral's `[TOOL_CALLS]`).

Text outside calls is content, sent as it comes except what may start the marker and a run of
whitespace, both held until known. A well-formed call and the whitespace around it read as the
whitespace before it (the first call's, for calls in a row), and as nothing at the content's start
or end: `"Let me look.\\n<tool_call>...</tool_call>\\nDone."` has the content `"Let me look.\\nDone."`.
A malformed call's text goes to content exactly as written (each family says when a call is malformed).
"""

from __future__ import annotations

from serving.tool_calls.stream import CallStream, held_prefix


class MarkedStream(CallStream):
    marker = ""  # set by the family

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.inside = False  # after an open marker, reading the call
        self.buf = ""  # outside: held text (whitespace, a marker's start); inside: text not yet read
        self.space = ""  # the whitespace before the open marker (kept with a malformed call)
        self.sep = ""  # what stands for the calls since the last content (sent before the next content)
        self.after_call = False  # outside, right after a call: leading whitespace is dropped
        self.wrote = False  # content was sent

    # the family's part -----------------------------------------------------------------------------
    def _read_inside(self) -> bool:
        """Read the call from `buf`; True when it was closed (`_called` / `_malformed`) and reading goes on."""
        raise NotImplementedError

    def _end_inside(self) -> None:
        """The output ended inside a call: `_called` or `_malformed`."""
        raise NotImplementedError

    # shared ----------------------------------------------------------------------------------------
    def _step(self, text: str) -> None:
        self.buf += text
        while self._read_inside() if self.inside else self._read_outside():
            pass

    def _text(self, text: str) -> None:
        """Content as written, after whatever stands for the calls before it."""
        if not text:
            return
        if self.wrote:
            self._content(self.sep)
        self._content(text)
        self.sep, self.wrote = "", True

    def _read_outside(self) -> bool:
        """Send what cannot start a call; True when a call opened (the caller reads on)."""
        if self.after_call:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self.after_call = False
        i = self.buf.find(self.marker)
        if i < 0:
            safe = self.buf[:len(self.buf) - held_prefix(self.buf, self.marker)].rstrip()
            self._text(safe)
            self.buf = self.buf[len(safe):]
            return False
        before = self.buf[:i]
        text = before.rstrip()
        self._text(text)
        self.space, self.buf, self.inside = before[len(text):], self.buf[i + len(self.marker):], True
        self._opened()
        return True

    def _opened(self) -> None:
        """A call's marker was just read (the family resets its reader)."""

    def _called(self, calls: list[tuple[str, str]]) -> None:
        for call in calls:
            self._call(*call)
        self.sep = self.sep or self.space
        self.inside, self.after_call = False, True

    def _malformed(self, text: str) -> None:
        """Not a call after all: the space before the marker, the marker and `text` are content."""
        self._text(self.space + self.marker + text)
        self.inside = False

    def _end(self) -> None:
        if self.inside:
            self._end_inside()
        else:
            self._text(self.buf)
        self.buf = ""

    def check_integrity(self) -> None:
        super().check_integrity()
        assert self.inside or self.marker not in self.buf, "a whole open marker is held outside a call"
        assert not self.space.strip() and not self.sep.strip(), "held whitespace holds more than whitespace"
