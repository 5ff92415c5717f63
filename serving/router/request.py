"""One request's life in the router, as one typed object (`Request`), and the error it fails with.

`Request` is the only per-request state: every other router module receives it explicitly
and none defines fields of its own on it. Its fields, in the order they are filled:
  - where its life stands (`history`, its last entry the `state`: request_state.State, moved
    only by `advance`, which refuses what LEGAL_TRANSITIONS does not allow);
  - what was asked (Generate's validation): id, session, prompt, the SequenceSpec sent to
    every tier, the handoff mode, the client's deadline;
  - the plan (`choose.Chooser.plan`): the prefill / relay instances, the MD that holds the
    session's context (`main_choice`) and the prefix hits, the pipeline with its reason and
    explanation;
  - the reservation: the MD that accepted it (`main`), every MD asked, and the instances whose
    `inflight` counts this request (`held`) until it settles (FINISHED or ENDED);
  - the transfers (`transfer`, `recovery`): what P reported (cached tokens, bytes, times, its
    first token), MD's KV landing (`main_kv`), the link estimate booked for it, the P instances
    that failed or replaced them, and the instances that freed the request themselves (`freed`);
  - the output (`stream`): the queues the tier streams feed, the tokens sent and their sources,
    the handoff figures and the timings.
`check_integrity()` asserts that the state agrees with the data (a path LEGAL_TRANSITIONS
allows, RELAY_STREAMING with a relay reservation, MAIN_STREAMING with MD's, a handoff position
exactly when the stream switched, ...; tests call it, the service when a request finishes).

`Abort` is how any stage fails a request: a gRPC code, one sentence, and the stage (metrics).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import TYPE_CHECKING

import grpc

from serving.pb import common_pb2
from serving.router.admission import Deadline
from serving.router.request_state import LEGAL_TRANSITIONS, SETTLED, STREAMING, IllegalTransition, State

if TYPE_CHECKING:
    from pddjax.policy import LinkEstimator
    from serving.pb import cluster_pb2
    from serving.router.pools import Instance

PIPELINE_NAMES = {common_pb2.PIPELINE_AUTO: "auto", common_pb2.PIPELINE_PDD: "pdd",
                  common_pb2.PIPELINE_PD_CROSS: "pd-cross", common_pb2.PIPELINE_PD_LOCAL: "pd-local"}
PIPELINES = {v: k for k, v in PIPELINE_NAMES.items()}  # policy's names -> common_pb2.Pipeline
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def status(code: int) -> grpc.StatusCode:
    """The status code a TransferDone or a RequestTokens carries as an int -> grpc.StatusCode
    (UNKNOWN for an int gRPC does not define)."""
    return _CODES.get(code, grpc.StatusCode.UNKNOWN)


class Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, stage: str = ""):
        super().__init__(message)
        self.code, self.message, self.stage = code, message, stage  # stage: where it failed (metrics)


def from_rpc(e: grpc.aio.AioRpcError, who: str) -> Abort:
    """A call to `who` failed -> its Abort. An UNAVAILABLE whose details do not name `who` (gRPC's
    own words for a peer that is gone: "failed to connect to all addresses ...") gets the name
    in front, so the client learns which part of the stack is down."""
    details = e.details() or f"{who} failed with {e.code().name}"
    if e.code() == grpc.StatusCode.UNAVAILABLE and who not in details:
        details = f"{who} unavailable: {details}"
    return Abort(e.code(), details, who)


class Inbox:
    """A request's one output queue: (role, TokenBatch | Abort) from both tiers, in arrival
    order. `listen(fn)`: fn() runs as items arrive, on the putter's stack (a DecodeStream's
    reader), so the reader (stream.Output) books each batch in the same loop pass and wakes its
    own task only when it has something to send; an item put while fn runs (a callback of fn's
    putting more) is read by that same run."""

    def __init__(self):
        self.items: collections.deque = collections.deque()
        self.listener = None
        self._running = False

    def put_nowait(self, item) -> None:
        self.items.append(item)
        if self.listener is not None and not self._running:
            self._running = True
            try:
                self.listener()
            finally:
                self._running = False

    def listen(self, fn) -> None:
        self.listener = fn

    def empty(self) -> bool:
        return not self.items

    def get_nowait(self):
        return self.items.popleft()


class Tagged:
    """One tier's side of a request's single output queue: `put_nowait(item)` queues
    (role, item), so `stream.Output` sees RLD's and MD's batches in arrival order."""

    def __init__(self, out: Inbox, role: int):
        self.out, self.role = out, role

    def put_nowait(self, item) -> None:
        self.out.put_nowait((self.role, item))


@dataclasses.dataclass(eq=False)
class Request:
    # ---- where its life stands (request_state) ----
    history: list[State] = dataclasses.field(default_factory=lambda: [State.VALIDATE], init=False)  # in order

    # ---- what was asked (Generate) ----
    deadline: Deadline = dataclasses.field(default_factory=lambda: Deadline(None))  # every downstream RPC's timeout
    t0: float = dataclasses.field(default_factory=time.perf_counter)  # received (TTFT, total)
    rid: str = ""  # this request's own id on P / RLD / MD: unique, never the client's
    label: str = ""  # the client's request id (a label: duplicates never interfere), else rid
    session: str = ""  # "" = no session
    prompt: list[int] = dataclasses.field(default_factory=list)
    max_tokens: int = 0
    requested: int = common_pb2.PIPELINE_AUTO  # the pipeline the client asked for
    spec: cluster_pb2.SequenceSpec | None = None  # what every tier is sent
    mode: int = common_pb2.HANDOFF_MODE_CHUNKED  # RLD -> MD handoff
    stream_interval: tuple[int, float] = (1, 0.0)  # tokens per user message, their longest wait in ms (interval.py)
    interval_at_source: bool = False  # RLD / MD group the tokens to `stream_interval` (StreamHold), not the router

    # ---- the plan (choose) ----
    pipeline: int = common_pb2.PIPELINE_AUTO  # the one served (a fallback to pd-local changes it)
    reason: str = ""  # why (policy.Decision.reason, "requested", "main-full", ...)
    explain: str = ""  # the sentence in the first response and the router's log
    sync_main: bool = False  # a filtered turn: push its context to `main_choice` afterwards
    prefill: Instance | None = None  # P
    relay: Instance | None = None  # RLD (picked unless pd-cross was requested)
    main_choice: Instance | None = None  # the MD the plan chose (the session's, else least loaded)
    hit_prefill: int = 0  # prompt tokens P's prefix cache holds
    hit_main: int = 0  # prompt tokens main_choice's DRC holds

    # ---- the reservation ----
    main: Instance | None = None  # the MD that accepted Reserve (main_choice or a fallback)
    main_asked: list[Instance] = dataclasses.field(default_factory=list)  # every MD sent a Reserve (all released)
    held: list[Instance] = dataclasses.field(default_factory=list)  # their `inflight` counts this request

    # ---- the transfers (transfer, recovery) ----
    cached_prefill: int = 0  # as P reported (prefilled.num_cached)
    cached_relay: int = 0  # RLD's own prefix hit (its Reserve): P sends RLD only the rest
    cached_main: int = 0  # MD's DRC prefix, pinned by its Reserve: P sends MD only the rest
    prefill_ms: float = 0.0
    queued_ms: float = 0.0  # waited for KV pages in the tiers' page queues (P, RLD, MD), part of TTFT
    first_token: int | None = None  # P's (MD taking over before RLD sent any token)
    first_logprob: object = None  # its common_pb2.TokenLogprob, when the request asked for logprobs
    tools: object = None  # tools.ToolPlan: the output is read for tool calls (None: no tools, or tool_choice none)
    bytes_relay: int = 0  # KV bytes P sent RLD
    bytes_main: int = 0  # KV bytes P sent MD (over the WAN), as encoded
    kv_wire_relay: str = "native"  # the KV wire format of P -> RLD (Transfers.choose_wire)
    kv_wire_main: str = "native"  # ... and of P -> MD
    main_kv_ms: float = 0.0  # P's push to MD, as P timed it
    main_kv: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # P reported MD's transfer
    main_kv_ok: bool = False  # ... and it was delivered
    link: LinkEstimator | None = None  # MD's link estimator while `planned` bytes are booked on it (None: settled)
    planned: int = 0
    prefill_tried: list[Instance] = dataclasses.field(default_factory=list)  # P instances that failed
    prefill_extra: list[Instance] = dataclasses.field(default_factory=list)  # the P instances that replaced them
    relay_pump: object = None  # decode_streams.Subscription: RLD's tokens into relay_out (pdd, pd-local)
    prefill_task: asyncio.Task | None = None  # P's events (transfer.Transfers._prefill)
    # instances that freed the request themselves, not sent the final Release: the P whose Prefill
    # call ended OK (its handler freed all), RLD once it answered the Release sent at the switch
    freed: list[Instance] = dataclasses.field(default_factory=list)
    tasks: list = dataclasses.field(default_factory=list)  # asyncio.Task | Subscription: cancelled when it ends

    # ---- the output (stream) ----
    out: Inbox = dataclasses.field(default_factory=Inbox)  # (role, TokenBatch | Abort), both tiers
    relay_out: Tagged = dataclasses.field(init=False)  # RLD's side of `out`
    main_out: Tagged = dataclasses.field(init=False)  # MD's side of `out`
    tokens: list[int] = dataclasses.field(default_factory=list)  # sent to the user
    sources: list[int] = dataclasses.field(default_factory=list)  # common_pb2.Role of each
    ttft: float | None = None  # seconds, t0 -> first token sent
    handoff_at: int | None = None  # output position where the stream switched from RLD to MD
    handoff_tokens: int = 0  # as RLD's Handoff answered
    handoff_chunks: int = 0
    handoff_t0: float = 0.0  # perf_counter when RLD's Handoff was called (0: not called)
    handoff_task: asyncio.Task | None = None  # that call (cancelled when MD is given up)
    main_given_up: str = ""  # "skipped" (no handoff) | "stopped" (handoff cancelled): give_up.py
    relay_t0: float = 0.0  # first and last relay batch (perf_counter): RLD's measured speed
    relay_t1: float = 0.0
    relay_after: int = 0  # relay tokens after the first batch

    def __post_init__(self):
        self.relay_out = Tagged(self.out, common_pb2.ROLE_RELAY)
        self.main_out = Tagged(self.out, common_pb2.ROLE_MAIN)

    @property
    def wants_logprobs(self) -> bool:
        return self.spec is not None and self.spec.sampling.logprobs

    @property
    def state(self) -> State:
        return self.history[-1]

    @property
    def stage(self) -> str:
        """Where Generate stands, as failure metrics name it: the last state before it settled."""
        return next(s.label for s in reversed(self.history) if s not in SETTLED)

    @property
    def admitted(self) -> bool:
        """It got an admission slot (Generate leaves it once, however the request ends)."""
        return State.PLAN in self.history

    @property
    def settled(self) -> bool:
        """It no longer loads its instances (a P replacing a failed one is not held)."""
        return self.state in SETTLED

    def advance(self, to: State) -> None:
        """Moves the request to `to`: IllegalTransition unless LEGAL_TRANSITIONS allows it from
        the current state. Reaching FINISHED or ENDED unloads every instance it held."""
        if to not in LEGAL_TRANSITIONS[self.state]:
            raise IllegalTransition(self.rid, self.state, to)
        self.history.append(to)
        if to in SETTLED:
            while self.held:
                self.held.pop().inflight -= 1

    @property
    def uses_relay(self) -> bool:
        return self.pipeline in (common_pb2.PIPELINE_PDD, common_pb2.PIPELINE_PD_LOCAL)

    @property
    def uses_main(self) -> bool:
        return self.pipeline in (common_pb2.PIPELINE_PDD, common_pb2.PIPELINE_PD_CROSS)

    def hold(self, inst: Instance) -> None:
        """`inst` now carries this request's load (its `inflight`), until it settles."""
        if not self.settled and inst not in self.held:
            inst.inflight += 1
            self.held.append(inst)

    def touched(self) -> list[Instance]:
        """Every instance that may hold something of this request (each released once)."""
        insts = [self.prefill] + ([self.relay] if self.uses_relay else []) + ([self.main] if self.main else [])
        insts += [i for i in self.main_asked + self.prefill_extra if i not in insts]  # a cancel mid-Reserve too
        return insts

    def check_integrity(self) -> None:
        path, state = self.history, self.state
        assert path[0] is State.VALIDATE, path
        for src, dst in zip(path, path[1:]):
            assert dst in LEGAL_TRANSITIONS[src], f"illegal path {' -> '.join(s.name for s in path)}"
        reserved = State.RESERVE in path
        streamed = any(s in STREAMING for s in path)
        assert self.pipeline in PIPELINE_NAMES, self.pipeline
        assert not reserved or self.pipeline != common_pb2.PIPELINE_AUTO, "past PLAN with no pipeline chosen"
        assert not self.sync_main or self.pipeline == common_pb2.PIPELINE_PD_LOCAL, "a context sync outside pd-local"
        assert len(set(map(id, self.held))) == len(self.held), "an instance is held twice"
        assert not self.held or reserved, "an instance held before RESERVE"
        assert not self.settled or not self.held, "a settled request still loads an instance"
        assert self.main is None or self.main in self.main_asked, "the reserved MD was never asked"
        if streamed:
            assert self.uses_main == (self.main is not None), f"MD reserved {self.main} for {self.pipeline}"
            assert not self.uses_relay or self.relay is not None, "a relay pipeline without RLD"
        if state is State.RELAY_STREAMING:
            assert self.uses_relay and self.relay is not None, "streaming from RLD without a relay reservation"
        if state is State.MAIN_STREAMING:
            assert self.uses_main and self.main is not None, "streaming from MD without an MD reservation"
        if State.RELAY_LOST in path:
            assert self.pipeline == common_pb2.PIPELINE_PDD and self.main is not None, "RLD lost with no MD"
        switched = State.RELAY_STREAMING in path and State.MAIN_STREAMING in path
        assert (self.handoff_at is not None) == switched, (self.handoff_at, [s.name for s in path])
        assert self.handoff_at is None or self.pipeline == common_pb2.PIPELINE_PDD, "a handoff outside pdd"
        assert not self.main_given_up or (self.main is not None and self.handoff_at is None), "MD given up, then used"
        assert self.main_given_up != "stopped" or self.handoff_t0, "a handoff stopped that never started"
        assert not self.tokens or streamed, "tokens before the stream opened"
        assert self.link is None or self.main is not None, "a link booking without MD"
        assert not self.main_kv_ok or self.main_kv.is_set(), "MD's KV delivered but not reported"
        touched = self.touched() if self.prefill is not None else []
        assert all(i in touched for i in self.freed), "an instance freed that the request never touched"
        assert len(self.tokens) == len(self.sources), (len(self.tokens), len(self.sources))
        assert self.relay_after >= 0 and self.relay_t0 <= self.relay_t1, (self.relay_t0, self.relay_t1)
