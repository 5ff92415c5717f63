"""When the router gives MD up for one pdd request: the handoff is not started, or is stopped,
because the request is predicted to end on RLD before the user's stream could move to MD.

With a chunked handoff RLD decodes on while MD extends RLD's tokens and decodes ahead of it;
the user's stream moves only once MD holds every token the user has (ahead.py). When the
request ends first, MD decoded all of it in vain: its CPU or accelerator time bought nothing,
and RLD did the whole request anyway. This is PDD's singular-traffic case seen after MD's KV
has landed (the report's filter decides it before the push; `pddjax.policy`).

`SwitchClock` (one per MD address) learns the seconds from a handoff's start to the switch:
  - a switched handoff adds its time (an exponential average);
  - one that ended unswitched after d seconds says the switch takes longer than d: an estimate
    under d is raised to d (a lower bound never lowers it);
  - a handoff given up lowers the estimate by GIVE_UP_DECAY, so an estimate left high by a
    busy spell is measured again once it has decayed below the requests' remaining time.
Before a handoff ended on an MD the estimate is `[router] handoff_switch_prior_s` (0: none,
and nothing is given up until one ended).

The rule (`due`): the request's remaining time on RLD, (max_tokens - the user's tokens) x
RLD's pace, is below the estimate minus the seconds the handoff has run. max_tokens bounds
the output, so a request that stops earlier (EOS, a stop string) is given up later, never
sooner. MD is then released with cache=True: P's push to it completed, so MD's DRC keeps the
prompt (the drift guard holds), and only MD's decoding for this request stops.
"""

from __future__ import annotations

ALPHA = 0.25  # weight of a new switch time in the average
GIVE_UP_DECAY = 0.98  # the estimate after each handoff given up, as a share of before
MIN_PACE_TOKENS = 4  # RLD's pace is the request's own after this many tokens (else the RLD estimate's)


class SwitchClock:
    """Seconds from a handoff's start to the user's stream moving to MD, for one MD."""

    def __init__(self, prior_s: float = 0.0):
        self.prior = prior_s if prior_s > 0 else None
        self.expected: float | None = self.prior  # None: no prior and no handoff ended yet
        self.switches = self.unswitched_count = self.given_up = 0

    def switched(self, seconds: float) -> None:
        self.expected = seconds if self.expected is None else (1 - ALPHA) * self.expected + ALPHA * seconds
        self.switches += 1

    def unswitched(self, seconds: float) -> None:
        """A handoff that ran `seconds` and ended (its request finished) without a switch."""
        self.expected = seconds if self.expected is None else max(self.expected, seconds)
        self.unswitched_count += 1

    def gave_up(self) -> None:
        if self.expected is not None:
            self.expected *= GIVE_UP_DECAY
        self.given_up += 1

    def due(self, remaining_s: float, elapsed_s: float) -> bool:
        """The request ends (in `remaining_s` on RLD) before the switch is expected, the handoff
        having run `elapsed_s` so far (0: not started)."""
        return self.expected is not None and remaining_s < self.expected - elapsed_s

    def stats(self) -> dict:
        return {"expected_s": self.expected, "switches": self.switches, "unswitched": self.unswitched_count,
                "given_up": self.given_up}

    def check_integrity(self) -> None:
        assert self.expected is None or self.expected >= 0, self.expected
        assert (self.expected is None) == (self.prior is None and self.switches + self.unswitched_count == 0), \
            self.stats()


def remaining_seconds(max_tokens: int, have: int, pace_s: float) -> float:
    """RLD's time to the request's end at most: the tokens max_tokens still allows x its pace."""
    return max(0, max_tokens - have) * pace_s


def relay_pace(relay_after: int, relay_t0: float, relay_t1: float, tokens_per_s: float) -> float:
    """Seconds per token of RLD for one request: its own measured pace after MIN_PACE_TOKENS
    tokens, else `tokens_per_s` (the RLD's learned speed, or its prior)."""
    if relay_after >= MIN_PACE_TOKENS and relay_t1 > relay_t0:
        return (relay_t1 - relay_t0) / relay_after
    return 1.0 / max(tokens_per_s, 1e-6)
