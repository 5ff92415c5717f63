"""A request's state on a Decode service (RLD or MD), and the table of them.

SlotState and LEGAL_TRANSITIONS: a reserved request's lifecycle (the engine thread moves it,
`Slot.move`; a move the table does not list raises IllegalTransition):

  RESERVED     sequence added, paused: its KV (RLD; MD in pd-cross) or RLD's handoff (MD in pdd) to come
  HELD         MD: RLD's catch-up chunks applied; MD decodes ahead of RLD, its output held for the final
  DECODING     output from `emit_from` on goes to the stream (the KV's known tokens, or the final handoff)
  HANDING_OFF  RLD: paused while MD takes the one-shot final handoff; decodes on if it fails
  CLOSED       the last item posted and the sequence released; leaves the table on the event loop

Slot: one reserved request. SlotTable: the slots by request id, the tombstones of cancelled
ids, and the engine-thread helpers that feed and end a slot's stream; one per service, shared
by the service (decode.py), its KV receiver (kv_receiver.py) and its handoff (handoff.py).
`check_integrity()` (both) asserts that each slot's state agrees with its data and with the
engine's sequences (the Decode service's Info reports it). RpcFailure: the status a stream or a
waiting RPC ends with.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from serving import rpc
from serving.engine.worker import resolve
from serving.pb import cluster_pb2

if TYPE_CHECKING:
    from pddjax.engines.paged_engine import PagedEngine
    from serving.engine.worker import EngineWorker

TOMBSTONES = 10000  # cancelled request ids remembered (a late Reserve for one is refused)


class SlotState(enum.Enum):
    """Where a reserved request is on this service (the module docstring says what each means)."""
    RESERVED = "reserved"
    HELD = "held"
    DECODING = "decoding"
    HANDING_OFF = "handing_off"
    CLOSED = "closed"


LEGAL_TRANSITIONS: dict[SlotState, set[SlotState]] = {
    SlotState.RESERVED: {SlotState.HELD, SlotState.DECODING, SlotState.CLOSED},
    SlotState.HELD: {SlotState.DECODING, SlotState.CLOSED},
    SlotState.DECODING: {SlotState.HANDING_OFF, SlotState.CLOSED},
    SlotState.HANDING_OFF: {SlotState.DECODING, SlotState.CLOSED},
    SlotState.CLOSED: set(),
}
WAITING = frozenset({SlotState.RESERVED, SlotState.HELD})  # its KV or the final handoff still to come


class IllegalTransition(Exception):
    """A slot was asked to move where LEGAL_TRANSITIONS does not lead (a bug); one sentence."""


@dataclasses.dataclass
class Slot:
    request_id: str
    out: asyncio.Queue  # TokenBatch | RpcFailure, read by the Decode stream
    state: SlotState = SlotState.RESERVED  # the engine thread moves it (move)
    emit_from: int | None = None  # output positions >= this go to the user (engine thread); set from DECODING on
    waiters: list = dataclasses.field(default_factory=list)  # (kv tokens needed, asyncio.Future)
    # set on the event loop once the slot is DECODING or CLOSED: a Handoff waiting for RLD to decode wakes
    started: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    touched: float = dataclasses.field(default_factory=time.monotonic)  # last RPC about it (lease)
    streams: int = 0  # open Decode streams (a stream keeps the lease)
    born: float = dataclasses.field(default_factory=time.monotonic)
    reported: bool = False  # logged once when it outlives LINGER_LEASES leases (diagnostics)
    sink: object = None  # a DecodeStream subscribed to it (decode_stream.Sink): its items go there, not to `out`
    # the request asked for logprobs: output position -> common_pb2.TokenLogprob, for the positions
    # not emitted yet (P's first token from the KV push; MD's tokens decoded while HELD)
    logprobs: dict | None = None

    @property
    def closed(self) -> bool:
        return self.state is SlotState.CLOSED

    def move(self, new: SlotState) -> None:
        """Engine thread: the slot's state becomes `new`; IllegalTransition unless LEGAL_TRANSITIONS
        leads there from the current state."""
        legal = LEGAL_TRANSITIONS[self.state]
        if new not in legal:
            raise IllegalTransition(f"slot {self.request_id} cannot move from {self.state.name} to {new.name} "
                                    f"(legal: {', '.join(sorted(s.name for s in legal)) or 'none'})")
        self.state = new

    def check_integrity(self, seq) -> None:
        """Engine thread: the state agrees with the slot's data and with `seq`, the engine's
        sequence of this request id (None when the engine holds none). AssertionError says what
        disagrees."""
        rid, name = self.request_id, self.state.name
        if self.state is SlotState.CLOSED:
            assert seq is None, f"slot {rid} is CLOSED but the engine still holds its sequence (and its pages)"
            assert not self.waiters, f"slot {rid} is CLOSED with {len(self.waiters)} HandoffTokens still waiting"
            return
        assert seq is not None, f"slot {rid} is {name} but the engine holds no sequence for it"
        if self.state in WAITING:
            assert self.emit_from is None, f"slot {rid} is {name} but emits from {self.emit_from}"
        else:
            assert self.emit_from is not None, f"slot {rid} is {name} but has no emit_from"
        if self.state in (SlotState.RESERVED, SlotState.HANDING_OFF):
            assert seq.paused, f"slot {rid} is {name} but its sequence is not paused"
        if self.state is SlotState.RESERVED:
            assert not self.waiters, f"slot {rid} is RESERVED with HandoffTokens waiting (no chunk applied yet)"
        if self.logprobs:
            n = len(seq.generated)
            bad = [p for p in self.logprobs if not 0 <= p < n]
            assert not bad, f"slot {rid} holds logprobs of output positions {bad[:3]} past its {n} tokens"


@dataclasses.dataclass
class RpcFailure:
    """How a Decode stream (or a HandoffTokens waiting on its ack) ends: aborted with this status."""
    code: grpc.StatusCode
    message: str


class SlotTable:
    """The requests reserved on one Decode service. A slot is added on the engine thread
    (Reserve) and leaves the table on the event loop once its stream is closed."""

    def __init__(self, engine: PagedEngine, worker: EngineWorker):
        self.engine, self.worker = engine, worker
        self._slots: dict[str, Slot] = {}
        self._cancelled: collections.OrderedDict[str, float] = collections.OrderedDict()

    def get(self, rid: str) -> Slot | None:
        return self._slots.get(rid)

    def __contains__(self, rid: str) -> bool:
        return rid in self._slots

    def __iter__(self) -> Iterator[Slot]:
        """The slots now (a copy: the table may change while the caller iterates)."""
        return iter(list(self._slots.values()))

    def add(self, slot: Slot) -> None:
        """Engine thread: the request is reserved (its sequence was added, paused)."""
        self._slots[slot.request_id] = slot

    def touch(self, rid: str) -> None:
        """Traffic about the request: its lease starts over."""
        slot = self._slots.get(rid)
        if slot is not None:
            slot.touched = time.monotonic()

    # ---- tombstones: a cancel leaves one, a Reserve or a KV push arriving late finds it ------
    def was_cancelled(self, rid: str) -> bool:
        return rid in self._cancelled

    def tombstone(self, rid: str) -> None:
        self._cancelled[rid] = time.monotonic()
        while len(self._cancelled) > TOMBSTONES:
            self._cancelled.popitem(last=False)

    # ---- engine-thread helpers --------------------------------------------------------------
    def put(self, slot: Slot, item) -> None:
        """Engine thread: one message (TokenBatch | RpcFailure) to the slot's stream (its Decode
        stream's queue, or the DecodeStream subscribed to it)."""
        self.worker.post(_deliver, slot, item)

    def put_token(self, slot: Slot, position: int, token: int) -> None:
        """Engine thread: one token at `position` (no logprob, not the last) to the slot's stream;
        what `put` of its one-token TokenBatch would deliver, without building that batch."""
        self.worker.post(_deliver_token, slot, position, token)

    def decode(self, slot: Slot, emit_from: int) -> None:
        """Engine thread: the slot's output flows from `emit_from` on (DECODING); what was
        generated from there is emitted now (and the stream closed if finished)."""
        if slot.state is not SlotState.DECODING:
            slot.move(SlotState.DECODING)
            self.worker.post(slot.started.set)
        slot.emit_from = emit_from
        self.emit_held(slot)

    def close(self, slot: Slot, item, cache: bool = True) -> None:
        """Engine thread: last message of the stream, drop the sequence (CLOSED). Should the
        engine's release raise, the slot still wakes its waiters and leaves the table (the
        exception goes on to the caller, the sequence still in the engine)."""
        if slot.closed:
            return
        slot.move(SlotState.CLOSED)
        self.put(slot, item)
        try:
            if slot.request_id in self.engine.seqs:
                self.engine.release(slot.request_id, cache=cache)
        finally:
            self.worker.post(slot.started.set)  # a pending Handoff wakes up and finds it gone
            for _, fut in slot.waiters:
                self.worker.post(resolve, fut, -1)
            slot.waiters.clear()
            self.worker.post(self._discard, slot)

    def _discard(self, slot: Slot) -> None:
        """Event loop: a closed slot leaves the table (unless its id names another slot by now)."""
        if self._slots.get(slot.request_id) is slot:
            del self._slots[slot.request_id]

    def check_integrity(self) -> None:
        """Engine thread: every slot's state agrees with its data and its engine sequence
        (Slot.check_integrity), and every sequence of the engine belongs to a slot."""
        slots = list(self._slots.items())  # (closed slots leave on the event loop meanwhile)
        for rid, slot in slots:
            assert slot.request_id == rid, f"slot {slot.request_id} is filed under {rid}"
            slot.check_integrity(self.engine.seqs.get(rid))
        orphans = sorted(set(self.engine.seqs) - {rid for rid, _ in slots})
        assert not orphans, f"sequences with no slot: {orphans[:5]}"

    def emit_held(self, slot: Slot) -> None:
        """Engine thread: emit everything generated from emit_from on; close if finished."""
        seq = self.engine.seqs[slot.request_id]
        toks = seq.generated[slot.emit_from:]
        finish = seq.finish_reason
        if toks or finish:
            batch = cluster_pb2.TokenBatch(start_position=slot.emit_from, token_ids=toks,
                                           finish_reason=rpc.FINISH[finish])
            if slot.logprobs is not None:
                for p in [p for p in slot.logprobs if p < slot.emit_from]:  # decoded ahead, sent by RLD instead
                    del slot.logprobs[p]
            if slot.logprobs is not None and toks:
                held = [slot.logprobs.pop(p, None) for p in range(slot.emit_from, slot.emit_from + len(toks))]
                if any(lp is None for lp in held):  # a token this service did not sample nor receive one for
                    missing = slot.emit_from + held.index(None)
                    self.close(slot, RpcFailure(grpc.StatusCode.INTERNAL, f"request {slot.request_id}: no logprob "
                                                                          f"for output position {missing}"),
                               cache=False)
                    return
                batch.logprobs.extend(held)
            if finish:
                self.close(slot, batch)
            else:
                self.put(slot, batch)

    def fail(self, e, rid: str, code: grpc.StatusCode, message: str) -> None:
        """Engine thread (a `worker.call`): end the request's stream with this status (a KV push
        that broke)."""
        slot = self._slots.get(rid)
        if slot is not None:
            self.close(slot, RpcFailure(code, message), cache=False)


def _deliver(slot: Slot, item) -> None:
    """Event loop: an item of the slot's stream to whoever reads it now."""
    if slot.sink is not None:
        slot.sink.add(slot, item)
    else:
        slot.out.put_nowait(item)


def _deliver_token(slot: Slot, position: int, token: int) -> None:
    """Event loop: one token of the slot's stream to whoever reads it now."""
    if slot.sink is not None:
        slot.sink.add_token(slot.request_id, position, token)
    else:
        slot.out.put_nowait(cluster_pb2.TokenBatch(start_position=position, token_ids=[token]))
