"""A request's state on a Decode service (RLD or MD), and the table of them.

Slot: one reserved request. SlotTable: the slots by request id, the tombstones of cancelled
ids, and the engine-thread helpers that feed and end a slot's stream; one per service, shared
by the service (decode.py), its KV receiver (kv_receiver.py) and its handoff (handoff.py).
RpcFailure: the status a stream or a waiting RPC ends with.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
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


@dataclasses.dataclass
class Slot:
    request_id: str
    out: asyncio.Queue  # TokenBatch | RpcFailure, read by the Decode stream
    emit_from: int | None = None  # output positions >= this go to the user (engine thread)
    waiters: list = dataclasses.field(default_factory=list)  # (kv tokens needed, asyncio.Future)
    closed: bool = False
    decoding: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # KV landed, tokens flow
    touched: float = dataclasses.field(default_factory=time.monotonic)  # last RPC about it (lease)
    streams: int = 0  # open Decode streams (a stream keeps the lease)
    born: float = dataclasses.field(default_factory=time.monotonic)
    reported: bool = False  # logged once when it outlives LINGER_LEASES leases (diagnostics)
    sink: object = None  # a DecodeStream subscribed to it (decode_stream.Sink): its items go there, not to `out`


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

    def close(self, slot: Slot, item, cache: bool = True) -> None:
        """Engine thread: last message of the stream, drop the sequence."""
        if slot.closed:
            return
        slot.closed = True
        self.put(slot, item)
        if slot.request_id in self.engine.seqs:
            self.engine.release(slot.request_id, cache=cache)
        self.worker.post(slot.decoding.set)  # a pending Handoff wakes up and finds it gone
        for _, fut in slot.waiters:
            self.worker.post(resolve, fut, -1)
        slot.waiters.clear()
        self.worker.post(self._slots.pop, slot.request_id, None)

    def emit_held(self, slot: Slot) -> None:
        """Engine thread: emit everything generated from emit_from on; close if finished."""
        seq = self.engine.seqs[slot.request_id]
        toks = seq.generated[slot.emit_from:]
        finish = seq.finish_reason
        if toks or finish:
            batch = cluster_pb2.TokenBatch(start_position=slot.emit_from, token_ids=toks,
                                           finish_reason=rpc.FINISH[finish])
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
