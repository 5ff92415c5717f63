"""One sequence's place in its grammar: advance through tokens, fill the next allowed-token mask.

A `Matcher` wraps a copy of a compiled grammar's `llguidance.LLMatcher`. `advance(ids)` takes
many tokens at once (a sequence admitted with tokens generated elsewhere, the RLD -> MD
handoff, goes through them all) and refuses, before consuming any, a list with a token the
grammar does not allow (`GrammarRejected`, naming the token and its position). `fill_mask`
writes the packed mask of the next position into an int32 row of ceil(V / 32) words (bit j of
word i allows token 32 * i + j); `fill_masks` fills many rows at once on llguidance's thread
pool. `is_finished()`: the grammar is complete and admits nothing more (its mask then allows
only EOS), the engine ends the row there with finish_reason "stop"; `rollback(n)` forgets the
last n tokens.
"""

from __future__ import annotations

import threading

import llguidance
import numpy as np

_executor = None  # llguidance's thread pool for `fill_masks` (built on first use)
_executor_lock = threading.Lock()


class GrammarRejected(ValueError):
    """A token the grammar does not allow at its position (one sentence)."""


class Matcher:
    def __init__(self, ll: llguidance.LLMatcher, words: int, kind: str, eos_ids: tuple[int, ...]):
        self.ll = ll
        self.words = words  # int32 words of a mask row
        self.kind = kind  # the spec's kind, for messages
        self.eos_ids = eos_ids
        self.consumed = 0  # tokens advanced through (EOS included)

    def advance(self, token_ids) -> None:
        """Consume tokens in order; GrammarRejected (nothing consumed) if any is not allowed."""
        ids = [int(t) for t in token_ids]
        if not ids:
            return
        ok = self.ll.validate_tokens(ids)
        if ok < len(ids):
            t = ids[ok]
            raise GrammarRejected(f"token {t} at output position {self.consumed + ok} is not allowed by the "
                                  f"request's {self.kind} grammar")
        if not self.ll.consume_tokens(ids):
            raise GrammarRejected(f"the {self.kind} grammar failed on tokens at output positions "
                                  f"{self.consumed}..{self.consumed + len(ids) - 1}: {self._error()}")
        self.consumed += len(ids)

    def allows(self, token: int) -> bool:
        """Whether `token` may come next. Does not change the matcher."""
        return self.ll.validate_tokens([int(token)]) == 1

    def fill_mask(self, out_row: np.ndarray) -> None:
        """The next position's packed mask into `out_row`: int32 [words], C-contiguous."""
        _check_row(out_row, self.words)
        self.ll.unsafe_compute_mask_ptr(out_row.ctypes.data, self.words * 4)
        if self.ll.is_error():
            raise GrammarRejected(f"the {self.kind} grammar cannot compute its next tokens: {self._error()}")

    def mask(self) -> np.ndarray:
        """The next position's packed mask, a fresh int32 [words] row."""
        row = np.zeros(self.words, np.int32)
        self.fill_mask(row)
        return row

    def is_finished(self) -> bool:
        """The grammar is complete and admits no further token but EOS."""
        return self.ll.is_stopped() and not self.ll.is_error()

    def is_accepting(self) -> bool:
        """The text so far is a complete match (EOS is allowed now)."""
        return self.ll.is_accepting()

    def rollback(self, n: int) -> None:
        """Forget the last n tokens advanced through."""
        if not 0 <= n <= self.consumed:
            raise ValueError(f"cannot roll back {n} tokens of a grammar that consumed {self.consumed}")
        if n and not self.ll.rollback(n):
            raise GrammarRejected(f"the {self.kind} grammar cannot roll back {n} tokens: {self._error()}")
        self.consumed -= n

    def check_integrity(self, generated: int | None = None) -> None:
        """Not in an error state; when `generated` is given, every one of that many tokens consumed."""
        assert not self.ll.is_error(), f"{self.kind} grammar matcher in an error state: {self._error()}"
        assert generated is None or self.consumed == generated, \
            f"{self.kind} grammar consumed {self.consumed} tokens, the sequence has {generated}"

    def _error(self) -> str:
        return self.ll.get_error().split("\n", 1)[0]


def _check_row(row: np.ndarray, words: int) -> None:
    if row.dtype != np.int32 or row.shape != (words,) or not row.flags.c_contiguous or not row.flags.writeable:
        raise ValueError(f"a mask row must be a writable C-contiguous int32 [{words}] array, got "
                         f"{row.dtype} {row.shape}")


def fill_masks(pairs, out: np.ndarray) -> None:
    """pairs: [(Matcher, row index)]; out: int32 [B, words], C-contiguous. Each matcher's next mask
    into its row (rows not named are left as they are); several at once on llguidance's threads."""
    if not pairs:
        return
    words = pairs[0][0].words
    if out.dtype != np.int32 or out.ndim != 2 or out.shape[1] != words or not out.flags.c_contiguous:
        raise ValueError(f"masks must be a C-contiguous int32 [B, {words}] array, got {out.dtype} {out.shape}")
    if len(pairs) == 1:
        m, r = pairs[0]
        m.fill_mask(out[r])
        return
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m.ll, r) for m, r in pairs], out.ctypes.data, words * 4, out.shape[0])
    for m, _ in pairs:
        if m.ll.is_error():
            raise GrammarRejected(f"the {m.kind} grammar cannot compute its next tokens: {m._error()}")
