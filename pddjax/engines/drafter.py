"""Prompt-lookup drafts for speculative decoding (plain Python, no jax, no numpy needed).

One `Drafter` per sequence holds its context (prompt + output) and an n-gram index over it:
for every n in min_ngram..max_ngram, the n-gram ending just before each position maps to the
most recent position that followed it. Appending a token adds an entry per n (O(new tokens) per
step, never a rescan); the n-grams ending at the last token are indexed one token late, so a
lookup of the context's own suffix finds an *earlier* occurrence only.

`propose(limit)`: the longest suffix (n from max_ngram down to min_ngram) seen earlier proposes
the tokens that followed it, up to k (the row's adaptive draft length, at most `limit`). A match
whose continuation runs into the suffix itself repeats with its period (a loop keeps looping).
`MIN_NGRAM` is 2: a single token seen before is weak evidence (most of text's tokens recur), and
its rejected drafts pulled a copying row's acceptance, and so its k, down (an offline replay of
`bench speculative`'s outputs through this drafter and the cost rule, the engine's measured step
costs: copy at 1 stream 1.29x -> 1.59x, 259 -> 359 drafted and 188 -> 289 accepted; agentic and
nomatch within 0.05x).

Adaptive k (`feedback(drafted, accepted)` after each verification): k doubles (to the bound)
when a whole draft is accepted, else becomes accepted + 1; an exponential average of the
acceptance (weight `ALPHA` per verification, `PRIOR` before the first) below `OFF_BELOW` turns
the row off (k = 0). An off row probes with one token after `PROBE_EVERY` proposals, so
acceptance can recover; each rejected probe doubles that wait (to `PROBE_EVERY_MAX`), an
accepted one resets it: a row with nothing to copy pays for a handful of probes, not one in 8.
"""

from __future__ import annotations

ALPHA = 0.3  # weight of the latest verification in the acceptance average
PRIOR = 1.0  # the acceptance average before a row's first verification (0.5 kept short copies from ever drafting)
OFF_BELOW = 0.15  # acceptance average under which a row stops drafting
PROBE_EVERY, PROBE_EVERY_MAX = 8, 64  # an off row's wait between probes: first, and after rejected probes
MIN_NGRAM = 2  # the shortest suffix whose earlier occurrence proposes a draft


class Drafter:
    def __init__(self, tokens: list[int], max_tokens: int, max_ngram: int = 3, min_ngram: int = MIN_NGRAM):
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"spec_max_tokens must be a positive integer, got {max_tokens!r}")
        if not isinstance(max_ngram, int) or not isinstance(min_ngram, int) or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram lengths must be integers with 1 <= min <= max, got {min_ngram!r}..{max_ngram!r}")
        self.max_tokens, self.max_ngram, self.min_ngram = max_tokens, max_ngram, min_ngram
        self.k = max_tokens  # the next draft's length (0: off, probing)
        self.acceptance = PRIOR  # exponential average of accepted / drafted
        self.drafted = self.accepted = 0  # totals over the sequence's life
        self._idle = 0  # proposals since the last probe while off
        self._probe_every = PROBE_EVERY  # proposals between an off row's probes
        self._probing = False  # the last proposal was a probe (its feedback sets the next wait)
        self.trimmed = 0  # proposals in a row the engine's cost rule dropped (speculate.worth_it)
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> the position that followed its latest occurrence
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append context tokens; each indexes the n-grams that end just before it (in bulk:
        a 64K-token prompt indexes in ~0.2 s here, a decode step's few tokens in microseconds)."""
        old = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        new, toks = len(self.tokens), self.tokens
        for n in range(self.min_ngram, self.max_ngram + 1):
            lo = max(old, n)  # the token at position i continues the n-gram toks[i - n:i]
            if lo < new:
                grams = zip(*(toks[lo - n + j:new - n + j] for j in range(n)))
                self.index.update(zip(grams, range(lo, new)))  # later positions overwrite earlier

    def sync(self, context: list[int]) -> None:
        """Catch up with a sequence's tokens (`context`: its prompt + generated): only the new
        ones are read; a shorter context (a rollback) truncates."""
        if len(context) < len(self.tokens):
            self.truncate(len(context))
        self.extend(context[len(self.tokens):])

    def sync_from(self, seq) -> None:
        """`sync` from an engine Sequence, reading only its new tokens (`tokens_between`)."""
        n, total = len(self.tokens), seq.num_tokens
        if total < n:
            self.truncate(total)
            n = total
        self.extend(seq.tokens_between(n, total))

    def truncate(self, length: int) -> None:
        """Forget the context from `length` on (a rare handoff rollback): the index is rebuilt."""
        if length < len(self.tokens):
            kept = self.tokens[:length]
            self.tokens, self.index = [], {}
            self.extend(kept)

    def propose(self, limit: int) -> list[int]:
        """Draft tokens to follow the context: at most min(k, limit); [] when none match, the row
        is off (between probes) or limit < 1. Does not change the index."""
        k = self.k
        if k == 0:
            self._idle += 1
            if self._idle < self._probe_every:
                return []
            self._idle, k = 0, 1
        probe = self.k == 0
        k = min(k, limit)
        L = len(self.tokens)
        if k < 1 or L < 1:
            return []
        for n in range(min(self.max_ngram, L), self.min_ngram - 1, -1):
            s = self.index.get(tuple(self.tokens[L - n:]))
            if s is not None and s < L:
                period = L - s  # the continuation runs into the suffix: repeat what followed
                self._probing = probe
                return [self.tokens[s + j % period] for j in range(k)]
        return []

    def feedback(self, drafted: int, accepted: int) -> None:
        """A verification of `drafted` tokens accepted the first `accepted`: adapt k."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafted tokens")
        if drafted == 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        if self._probing:
            self._probing = False
            self._probe_every = PROBE_EVERY if accepted else min(2 * self._probe_every, PROBE_EVERY_MAX)
        self.acceptance = (1 - ALPHA) * self.acceptance + ALPHA * accepted / drafted
        if self.acceptance < OFF_BELOW:
            self.k = 0
        elif accepted == drafted:
            self.k = min(self.max_tokens, max(1, 2 * drafted))
        else:
            self.k = min(self.max_tokens, accepted + 1)

    def check_integrity(self) -> None:
        """The index is exactly what a rescan of the context gives; k and the totals in bounds."""
        expected: dict[tuple[int, ...], int] = {}
        for i in range(1, len(self.tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                expected[tuple(self.tokens[i - n:i])] = i
        assert self.index == expected, "drafter index differs from a rescan of its context"
        assert 0 <= self.k <= self.max_tokens, f"draft length {self.k} outside 0..{self.max_tokens}"
        assert 0 <= self.accepted <= self.drafted, f"accepted {self.accepted} of {self.drafted} drafted"
        assert PROBE_EVERY <= self._probe_every <= PROBE_EVERY_MAX, f"probe wait {self._probe_every}"
