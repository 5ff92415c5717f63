"""One request's life in the router, as one typed object (`Request`), and the error it fails with.

`Request` is the only per-request state: every other router module receives it explicitly
and none defines fields of its own on it. Its fields, in the order they are filled:
  - what was asked (Generate's validation): id, session, prompt, the SequenceSpec sent to
    every tier, the handoff mode, the client's deadline, and where Generate stands (`stage`);
  - the plan (`choose.Chooser.plan`): the prefill / relay instances, the MD that holds the
    session's context (`main_choice`) and the prefix hits, the pipeline with its reason and
    explanation;
  - the reservation: the MD that accepted it (`main`), every MD asked, and the instances whose
    `inflight` counts this request (`held`) until it settles;
  - the transfers (`transfer`, `recovery`): what P reported (cached tokens, bytes, times, its
    first token), MD's KV landing (`main_kv`), the link estimate booked for it, the P instances
    that failed or replaced them, and whether RLD's stream was lost;
  - the output (`stream`): the queues the tier streams feed, the tokens sent and their sources,
    the handoff figures and the timings.
`check_integrity()` asserts what must hold between them (tests call it; the service calls it
when a request settles).

`Abort` is how any stage fails a request: a gRPC code, one sentence, and the stage (metrics).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING

import grpc

from serving.pb import common_pb2
from serving.router.admission import Deadline

if TYPE_CHECKING:
    from pddjax.policy import LinkEstimator
    from serving.pb import cluster_pb2
    from serving.router.pools import Instance

PIPELINE_NAMES = {common_pb2.PIPELINE_AUTO: "auto", common_pb2.PIPELINE_PDD: "pdd",
                  common_pb2.PIPELINE_PD_CROSS: "pd-cross", common_pb2.PIPELINE_PD_LOCAL: "pd-local"}
PIPELINES = {v: k for k, v in PIPELINE_NAMES.items()}  # policy's names -> common_pb2.Pipeline
CODES = {c.value[0]: c for c in grpc.StatusCode}  # the int in a TransferDone -> grpc.StatusCode


class Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, stage: str = ""):
        super().__init__(message)
        self.code, self.message, self.stage = code, message, stage  # stage: where it failed (metrics)


def from_rpc(e: grpc.aio.AioRpcError, who: str) -> Abort:
    return Abort(e.code(), e.details() or f"{who} failed with {e.code().name}", who)


def _queue() -> asyncio.Queue:
    return asyncio.Queue()


class Tagged:
    """One tier's side of a request's single output queue: `put_nowait(item)` queues
    (role, item), so `stream.Output` sees RLD's and MD's batches in arrival order."""

    def __init__(self, out: asyncio.Queue, role: int):
        self.out, self.role = out, role

    def put_nowait(self, item) -> None:
        self.out.put_nowait((self.role, item))


@dataclasses.dataclass(eq=False)
class Request:
    # ---- what was asked (Generate) ----
    deadline: Deadline = dataclasses.field(default_factory=lambda: Deadline(None))  # every downstream RPC's timeout
    t0: float = dataclasses.field(default_factory=time.perf_counter)  # received (TTFT, total)
    stage: str = "validate"  # validate | admission | plan | reserve | stream (failure metrics)
    admitted: bool = False  # holds an admission slot (released by Generate)
    rid: str = ""  # this request's own id on P / RLD / MD: unique, never the client's
    label: str = ""  # the client's request id (a label: duplicates never interfere), else rid
    session: str = ""  # "" = no session
    prompt: list[int] = dataclasses.field(default_factory=list)
    max_tokens: int = 0
    requested: int = common_pb2.PIPELINE_AUTO  # the pipeline the client asked for
    spec: cluster_pb2.SequenceSpec | None = None  # what every tier is sent
    mode: int = common_pb2.HANDOFF_MODE_CHUNKED  # RLD -> MD handoff

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
    settled: bool = False  # no longer loads its instances (a P replacing a failed one is not held)

    # ---- the transfers (transfer, recovery) ----
    cached_prefill: int = 0  # as P reported (prefilled.num_cached)
    cached_relay: int = 0  # RLD's own prefix hit (its Reserve): P sends RLD only the rest
    cached_main: int = 0  # MD's DRC prefix, pinned by its Reserve: P sends MD only the rest
    prefill_ms: float = 0.0
    queued_ms: float = 0.0  # waited for KV pages in the tiers' page queues (P, RLD, MD), part of TTFT
    first_token: int | None = None  # P's (MD taking over before RLD sent any token)
    bytes_relay: int = 0  # KV bytes P sent RLD
    bytes_main: int = 0  # KV bytes P sent MD (over the WAN), as encoded
    kv_wire_relay: str = "native"  # the KV wire format of P -> RLD (Transfers.choose_wire)
    kv_wire_main: str = "native"  # ... and of P -> MD
    main_kv_ms: float = 0.0  # P's push to MD, as P timed it
    main_kv: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # P reported MD's transfer
    main_kv_ok: bool = False  # ... and it was delivered
    link: LinkEstimator | None = None  # MD's link estimator, `planned` bytes booked on it
    planned: int = 0
    link_done: bool = False  # the booking was settled (measured or failed)
    prefill_tried: list[Instance] = dataclasses.field(default_factory=list)  # P instances that failed
    prefill_extra: list[Instance] = dataclasses.field(default_factory=list)  # the P instances that replaced them
    relay_lost: bool = False  # RLD's stream broke or its KV failed: MD took over (or tried); no RLD handoff
    relay_pump: object = None  # decode_streams.Subscription: RLD's tokens into relay_out (pdd, pd-local)
    relay_released: bool = False  # RLD answered the Release sent when the stream moved to MD
    prefill_task: asyncio.Task | None = None  # P's events (transfer.Transfers._prefill)
    prefill_done: Instance | None = None  # the P whose Prefill call ended OK: its handler freed all (no Release)
    tasks: list = dataclasses.field(default_factory=list)  # asyncio.Task | Subscription: cancelled when it ends

    # ---- the output (stream) ----
    out: asyncio.Queue = dataclasses.field(default_factory=_queue)  # (role, TokenBatch | Abort), both tiers
    relay_out: Tagged = dataclasses.field(init=False)  # RLD's side of `out`
    main_out: Tagged = dataclasses.field(init=False)  # MD's side of `out`
    tokens: list[int] = dataclasses.field(default_factory=list)  # sent to the user
    sources: list[int] = dataclasses.field(default_factory=list)  # common_pb2.Role of each
    finished: bool = False  # the user's stream has its last message
    ttft: float | None = None  # seconds, t0 -> first token sent
    handoff_at: int | None = None  # output position where the stream switched to MD
    handoff_tokens: int = 0  # as RLD's Handoff answered
    handoff_chunks: int = 0
    relay_t0: float = 0.0  # first and last relay batch (perf_counter): RLD's measured speed
    relay_t1: float = 0.0
    relay_after: int = 0  # relay tokens after the first batch

    def __post_init__(self):
        self.relay_out = Tagged(self.out, common_pb2.ROLE_RELAY)
        self.main_out = Tagged(self.out, common_pb2.ROLE_MAIN)

    @property
    def uses_relay(self) -> bool:
        return self.pipeline in (common_pb2.PIPELINE_PDD, common_pb2.PIPELINE_PD_LOCAL)

    @property
    def uses_main(self) -> bool:
        return self.pipeline in (common_pb2.PIPELINE_PDD, common_pb2.PIPELINE_PD_CROSS)

    def hold(self, inst: Instance) -> None:
        """`inst` now carries this request's load (its `inflight`), until `unhold`."""
        if not self.settled and inst not in self.held:
            inst.inflight += 1
            self.held.append(inst)

    def unhold(self) -> None:
        """Idempotent: the request no longer loads its instances (settled, or failed)."""
        self.settled = True
        while self.held:
            self.held.pop().inflight -= 1

    def touched(self) -> list[Instance]:
        """Every instance that may hold something of this request (each released once)."""
        insts = [self.prefill] + ([self.relay] if self.uses_relay else []) + ([self.main] if self.main else [])
        insts += [i for i in self.main_asked + self.prefill_extra if i not in insts]  # a cancel mid-Reserve too
        return insts

    def check_integrity(self) -> None:
        assert self.pipeline in PIPELINE_NAMES, self.pipeline
        assert self.stage in ("validate", "admission", "plan") or self.pipeline != common_pb2.PIPELINE_AUTO
        assert len(set(map(id, self.held))) == len(self.held), "an instance is held twice"
        assert not self.settled or not self.held, "a settled request still loads an instance"
        assert not self.finished or self.settled, "finished but not settled"
        assert self.main is None or self.main in self.main_asked, "the reserved MD was never asked"
        if self.stage == "stream":
            assert self.uses_main == (self.main is not None), (self.pipeline, self.main)
            assert not self.uses_relay or self.relay is not None, "a relay pipeline without RLD"
        assert not self.relay_lost or self.main is not None, "RLD lost with no MD to take over"
        assert self.handoff_at is None or self.pipeline == common_pb2.PIPELINE_PDD, "a handoff outside pdd"
        assert self.link is None or self.main is not None, "a link booking without MD"
        assert not self.link_done or self.link is not None
        assert not self.main_kv_ok or self.main_kv.is_set(), "MD's KV delivered but not reported"
        assert len(self.tokens) == len(self.sources), (len(self.tokens), len(self.sources))
        assert self.relay_after >= 0 and self.relay_t0 <= self.relay_t1, (self.relay_t0, self.relay_t1)
