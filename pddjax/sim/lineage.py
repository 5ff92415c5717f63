"""Which cached sequence shares how many leading tokens with a request's prompt.

A trace says only how much turn n shares with its *source* (turn n-1's prompt + output, or
the doc for turn 0): `prefix[n]`. A cache may hold an older state of the session: turn m's
sequence, `len_m` tokens (P caches prompts, MD's DRC prompt + output). Prefixes compose by
minimum, so

    shared(turn n, cached turn m) = min(prefix[m+1], ..., prefix[n], len_m)     (m < n)
    shared(turn n, doc)           = min(prefix[0], ..., prefix[n], doc_len)

Session entries are keyed ("s", session_id), doc entries ("d", doc_id).
"""

from __future__ import annotations

from pddjax.sim.cache import PrefixCache


class Lineage:
    """Per-session list of prefix lengths, appended as turns are issued."""

    def __init__(self):
        self._prefix: dict[int, list[int]] = {}  # session_id -> prefix of turns 0..n

    def add(self, sid: int, turn: int, prefix: int) -> None:
        chain = self._prefix.setdefault(sid, [])
        if turn != len(chain):
            raise ValueError(f"session {sid}: turn {turn} issued out of order")
        chain.append(prefix)

    def shared_with_turn(self, sid: int, n: int, m: int, len_m: int) -> int:
        """Leading tokens turn n's prompt shares with turn m's cached sequence."""
        if m >= n or m < 0:
            return 0
        return min(min(self._prefix[sid][m + 1 : n + 1]), len_m)

    def shared_with_doc(self, sid: int, n: int, doc_len: int) -> int:
        """Leading tokens turn n's prompt shares with the session's doc."""
        return min(min(self._prefix[sid][: n + 1]), doc_len)

    def cached_hit(self, cache: PrefixCache, req) -> int:
        """Best reuse for `req` in `cache` (session entry or doc entry). Does not modify it."""
        best = 0
        e = cache.get(("s", req.sid))
        if e is not None:
            best = self.shared_with_turn(req.sid, req.turn, e.turn, e.tokens)
        d = cache.get(("d", req.doc))
        if d is not None:
            best = max(best, self.shared_with_doc(req.sid, req.turn, d.tokens))
        return min(best, req.prompt)
