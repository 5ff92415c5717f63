"""MD's batches while RLD is still the user's source (chunked pdd), and when the stream may move.

After the final handoff chunk MD emits from its end while RLD decodes on, so MD's first batches
overlap what the user already has. `Ahead` keeps them by position (contiguous) and judges, after
every batch, whether the user's stream may move to MD:

  SWITCH   MD holds every token the user has, and they are the same: the stream moves now.
  WAIT     MD agrees so far and is close (at most SWITCH_LAG tokens, or SWITCH_WAIT_S at RLD's
           pace, or FORCE_WAIT_S once FORCE_AFTER_S passed since its first batch): the router holds
           RLD's batches back (the user waits about as long as the lag) until MD covers the
           user's position (SWITCH) or proves different (NO).
  NO       MD differs from the user's tokens (a heterogeneous pair: another dtype, page size or
           backend may break a near-tie the other way), failed, left a hole, or finished short:
           RLD keeps the request to its end.
  PENDING  nothing to judge yet (no batch, or MD's first position not yet reached by the user).

The user's stream therefore only moves to MD once MD's tokens equal every token the user was
sent, whatever the pair: MD's later tokens continue the user's text, never a different one.
"""

from __future__ import annotations

import enum
import sys
import time

from serving.pb import common_pb2
from serving.router.request import Abort

# The stream moves to MD once MD is at most SWITCH_LAG tokens behind the user, or its lag costs
# the user at most SWITCH_WAIT_S at RLD's pace (a fast model lags more tokens in the same time);
# FORCE_AFTER_S after MD's first batch (MD does not gain on RLD) a wait up to FORCE_WAIT_S is taken.
SWITCH_LAG, SWITCH_WAIT_S = 1, 0.1
FORCE_AFTER_S, FORCE_WAIT_S = 0.5, 0.4


class Verdict(enum.Enum):
    PENDING = "pending"
    WAIT = "wait"
    SWITCH = "switch"
    NO = "no"


class Ahead:
    """MD's tokens (and logprobs) from output position `at`, held while RLD is the source."""

    def __init__(self, label: str, wants_logprobs: bool):
        self.label, self.wants_logprobs = label, wants_logprobs
        self.tokens: list[int] | None = []  # None: MD disagreed, failed or left a hole: never switch
        self.logprobs: list = []
        self.at = 0  # output position of tokens[0]
        self.finish = common_pb2.FINISH_REASON_UNSPECIFIED  # MD finished within `tokens`
        self.t0 = 0.0  # when MD's first batch came (perf_counter)

    def drop(self, why: str | None = None) -> None:
        """Never switch to MD for this request (`why`, when given, is logged)."""
        if why is not None and self.tokens is not None:
            print(f"router: {self.label}: {why}: the stream stays on RLD", file=sys.stderr, flush=True)
        self.tokens = None

    def add(self, it) -> None:
        """An MD batch (or MD's Abort) while RLD is the source."""
        if self.tokens is None:
            return
        if isinstance(it, Abort):  # MD failed before the switch: RLD goes on alone
            self.drop()
            return
        if it.token_ids:
            if self.wants_logprobs and len(it.logprobs) != len(it.token_ids):
                self.drop()  # MD's batch lacks logprobs: never switch on it
                return
            if not self.tokens:
                self.at, self.t0, self.logprobs = it.start_position, time.perf_counter(), []
            elif it.start_position != self.at + len(self.tokens):
                self.drop()  # a hole in MD's stream: never switch on it
                return
            self.tokens += it.token_ids
            self.logprobs += it.logprobs
        self.finish = self.finish or it.finish_reason

    def verdict(self, user: list[int], per_token: float) -> Verdict:
        """Whether the stream may move to MD, the user holding `user`; `per_token`: RLD's pace (s)."""
        ahead = self.tokens
        if ahead is None:
            return Verdict.NO
        if not ahead or self.at > len(user):
            return Verdict.PENDING
        seen = user[self.at:self.at + len(ahead)]
        if ahead[:len(seen)] != seen:
            at = next(i for i, (a, b) in enumerate(zip(ahead, seen)) if a != b)
            self.drop(f"MD's token {ahead[at]} at position {self.at + at} differs from RLD's {seen[at]}")
            return Verdict.NO
        lag = len(user) - (self.at + len(ahead))  # tokens MD still has to make to reach the user
        if lag <= 0:
            return Verdict.SWITCH
        if self.finish:
            self.drop(f"MD finished at position {self.at + len(ahead)}, before the user's {len(user)}")
            return Verdict.NO
        wait = lag * per_token
        late = time.perf_counter() - self.t0 > FORCE_AFTER_S  # MD does not gain on RLD: RLD stops
        if lag <= SWITCH_LAG or wait <= SWITCH_WAIT_S or (late and wait <= FORCE_WAIT_S):
            return Verdict.WAIT
        return Verdict.PENDING
