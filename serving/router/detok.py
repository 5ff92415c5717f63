"""Incremental detokenization with stop strings, O(batch) per batch (no re-decode of the whole
output, no scan of the whole text).

Byte-level and SentencePiece tokenizers cannot decode one token alone (a character may span
tokens; a leading space depends on the previous token), so the text of the tokens after
`read` is the decode of tokens[prefix:] minus the decode of tokens[prefix:read], where
`prefix` is where the previous batch began (the approach of TGI and vLLM: a boundary where
the text was whole). An incomplete UTF-8
sequence ("\\ufffd" at the end) is held back until the next batch completes it. Text that may
be the start of a stop string is held back too (the user never sees part of a stop string),
so a stop string is searched only in that held text plus the new text: at most the longest
stop string plus one batch.
"""

from __future__ import annotations

# Batches an incomplete character is held back for at most (invalid bytes never complete one).
MAX_HELD_BATCHES = 4


class IncrementalText:
    """Feeds `add(tokens)` the whole token list so far (only its tail is decoded) -> new text."""

    def __init__(self, tokenizer, stop_strings):
        self.tok = tokenizer
        self.stops = [s for s in stop_strings if s]
        self.prefix = 0  # tokens before this are never decoded again
        self.read = 0  # tokens before this have had their text emitted
        self.pending = ""  # decoded text not sent yet: it may be the start of a stop string
        self.stopped = False
        self.held = 0  # batches waited for the end of a character
        self.decoded_tokens = 0  # tokens passed to the tokenizer in all (tests: stays O(n))

    def _decode(self, ids) -> str:
        self.decoded_tokens += len(ids)
        return self.tok.decode(ids, skip_special=True)

    def add(self, tokens: list[int], final: bool = False) -> tuple[str, bool]:
        """`tokens`: every output token so far -> (text to send now, a stop string ended the text).
        `final`: the last batch (a held-back incomplete character is sent as it is)."""
        if self.tok is None or self.stopped:
            return "", self.stopped
        if len(tokens) <= self.read:  # no new token (a finish alone sends what was held back)
            return self._stop("", final) if final else ("", False)
        before = self._decode(tokens[self.prefix:self.read]) if self.read > self.prefix else ""
        after = self._decode(tokens[self.prefix:])
        if (after.endswith("\ufffd") or len(after) < len(before)) and self.held < MAX_HELD_BATCHES and not final:
            self.held += 1  # an incomplete character: wait for the next batch
            return "", False
        self.held = 0
        delta = after[len(before):]
        self.prefix, self.read = self.read, len(tokens)  # `read` ends on a whole character
        return self._stop(delta, final)

    def _stop(self, delta: str, final: bool) -> tuple[str, bool]:
        """Text that may begin a stop string is held back (`pending`) until it cannot, so the user
        never gets part of a stop string; a stop string can only start inside `pending` + delta."""
        buf = self.pending + delta
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.pending = True, ""
            return buf[:cut], True
        hold = 0 if final else max((_prefix_suffix(buf, s) for s in self.stops), default=0)
        self.pending = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False


def _prefix_suffix(text: str, stop: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `stop` (< len(stop))."""
    i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while i >= 0:
        if stop.startswith(text[i:]):
            return len(text) - i
        i = text.find(stop[0], i + 1)
    return 0
