"""A router request's lifecycle: one `State` per stage of Generate and of the user's stream, and
the moves allowed between them (`LEGAL_TRANSITIONS`; `Request.advance` refuses any other).

    VALIDATE -> ADMISSION -> PLAN -> RESERVE
    RESERVE -> RELAY_STREAMING (pdd, pd-local) | MAIN_STREAMING (pd-cross) | ENDED
    RELAY_STREAMING -> MAIN_STREAMING (pdd: the switch to MD) | RELAY_LOST (pdd) | FINISHED | ENDED
    RELAY_LOST -> MAIN_STREAMING (MD took over) | FINISHED | ENDED
    MAIN_STREAMING -> FINISHED | ENDED
    FINISHED -> ENDED

A request refused before RESERVE (INVALID_ARGUMENT, RESOURCE_EXHAUSTED at admission, no instance
in the plan) stays in the state it failed in: it holds nothing and nothing is released. From
RESERVE on, `service._end` moves it to ENDED however it ends. RELAY_LOST is pdd's RLD gone
(its stream broke or its KV failed): MD takes the request over (-> MAIN_STREAMING) or the
error stands (-> ENDED); RLD is no longer handed off.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    VALIDATE = "validate"  # the request is read and checked
    ADMISSION = "admission"  # waiting for an admission slot (held from PLAN on, released by Generate)
    PLAN = "plan"  # instances, prefix hits and the pipeline chosen
    RESERVE = "reserve"  # Reserve on MD and RLD, the instances held; the first message sent
    RELAY_STREAMING = "relay-streaming"  # the user's tokens come from RLD (pdd, pd-local)
    RELAY_LOST = "relay-lost"  # pdd: RLD's stream broke or its KV failed; MD takes over (or tries)
    MAIN_STREAMING = "main-streaming"  # the user's tokens come from MD (pd-cross; pdd after the switch)
    FINISHED = "finished"  # the user's stream has its last message; the request loads no instance
    ENDED = "ended"  # its tasks cancelled, its tiers being released; loads no instance

    @property
    def label(self) -> str:
        """The stage name in failure metrics and logs (every streaming state is "stream")."""
        return "stream" if self in STREAMING or self is State.FINISHED else self.value


STREAMING = frozenset({State.RELAY_STREAMING, State.RELAY_LOST, State.MAIN_STREAMING})
SETTLED = frozenset({State.FINISHED, State.ENDED})  # no longer loads its instances (`Request.hold` refuses)

LEGAL_TRANSITIONS: dict[State, frozenset[State]] = {
    State.VALIDATE: frozenset({State.ADMISSION}),
    State.ADMISSION: frozenset({State.PLAN}),
    State.PLAN: frozenset({State.RESERVE}),
    State.RESERVE: frozenset({State.RELAY_STREAMING, State.MAIN_STREAMING, State.ENDED}),
    State.RELAY_STREAMING: frozenset({State.RELAY_LOST, State.MAIN_STREAMING, State.FINISHED, State.ENDED}),
    State.RELAY_LOST: frozenset({State.MAIN_STREAMING, State.FINISHED, State.ENDED}),
    State.MAIN_STREAMING: frozenset({State.FINISHED, State.ENDED}),
    State.FINISHED: frozenset({State.ENDED}),
    State.ENDED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A request asked to move where its lifecycle does not go (a router bug, never a user's)."""

    def __init__(self, rid: str, src: State, dst: State):
        legal = ", ".join(sorted(s.name for s in LEGAL_TRANSITIONS[src])) or "nothing (terminal)"
        super().__init__(f"request {rid or '?'}: illegal transition {src.name} -> {dst.name} "
                         f"(from {src.name}: {legal})")
        self.src, self.dst = src, dst
