"""DecodeStream: many requests' Decode streams on one gRPC stream. The router opens one per RLD /
MD instance, so a step's tokens for every request it serves cross in one message, not one
message per request per token (the profile of issue 18: ~45 us of server and ~55 us of client
CPU per streamed message on this VM, most of the router's time).

The caller subscribes request ids (`DecodeStreamRequest.subscribe`); each is then served as
`Decode(request_id)` would be: what its slot queued so far, then every TokenBatch, and the end
(a finish, a handoff, or a status in `RequestTokens.code`: NOT_FOUND for an id not reserved
here, INTERNAL for a step that failed, ...). Unsubscribing is cancelling that Decode call. A
subscription counts as an open Decode stream for the slot's lease (`Slot.streams`); the stream
ending (the caller gone) ends all of its subscriptions.

The engine thread's posts of one step reach the event loop together (`worker._flush`), each
item lands here (`SlotTable.put` -> `Slot.sink`), and the writer sends everything ready in one
`DecodeStreamResponse`, a request's contiguous batches merged into one entry.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc

from serving.engine.slot import RpcFailure
from serving.pb import cluster_pb2

if TYPE_CHECKING:
    from serving.engine.slot import Slot, SlotTable


class Sink:
    """One DecodeStream's subscriptions and the entries ready to send (event-loop thread only)."""

    def __init__(self, slots: SlotTable, role: str):
        self.slots, self.role = slots, role
        self.subscribed: dict[str, Slot] = {}
        self.ready_msg = cluster_pb2.DecodeStreamResponse()  # the entries ready, in arrival order (the next message)
        self._open: dict[str, cluster_pb2.RequestTokens] = {}  # a request's last ready batch (merging)
        self.ready = asyncio.Event()
        self.draining = False  # the service drains: the stream ends once no subscription is left

    def subscribe(self, rid: str) -> None:
        slot = self.slots.get(rid)
        if slot is None:
            self._append(rid, RpcFailure(grpc.StatusCode.NOT_FOUND, f"request {rid} is not reserved on {self.role}"))
            return
        if slot.sink is not None:  # another stream had it: this one takes over, as a second Decode call would
            slot.sink.unsubscribe(rid)
        slot.streams += 1
        self.subscribed[rid] = slot
        held = []
        while not slot.out.empty():  # queued before the subscription (no reader yet)
            held.append(slot.out.get_nowait())
        slot.sink = self
        for item in held:
            self.add(slot, item)

    def unsubscribe(self, rid: str) -> None:
        slot = self.subscribed.pop(rid, None)
        if slot is None:
            return
        if slot.sink is self:
            slot.sink = None
        slot.streams -= 1
        slot.touched = time.monotonic()

    def add(self, slot: Slot, item) -> None:
        """An item of a subscribed slot's stream (TokenBatch | RpcFailure); one that ends it ends
        the subscription."""
        rid = slot.request_id
        if rid not in self.subscribed:
            return
        self._append(rid, item)
        if isinstance(item, RpcFailure) or item.finish_reason or item.handed_off:
            self.unsubscribe(rid)

    def add_token(self, rid: str, position: int, token: int) -> None:
        """One token (no logprob, not the last) of a subscribed request: `add` of its one-token
        TokenBatch, written straight into the ready message."""
        if rid not in self.subscribed:
            return
        last = self._open.get(rid)
        if last is not None and _follows(last.batch, position):
            last.batch.token_ids.append(token)
            return
        entry = self.ready_msg.items.add(request_id=rid)
        entry.batch.start_position = position
        entry.batch.token_ids.append(token)
        self._open[rid] = entry
        self.ready.set()

    def _append(self, rid: str, item) -> None:
        if isinstance(item, RpcFailure):
            self._open.pop(rid, None)
            self.ready_msg.items.add(request_id=rid, code=item.code.value[0], error=item.message)
        else:
            last = self._open.get(rid)
            if last is not None and _continues(last.batch, item):
                last.batch.token_ids.extend(item.token_ids)
                last.batch.logprobs.extend(item.logprobs)
                last.batch.finish_reason = item.finish_reason
            else:
                entry = self.ready_msg.items.add(request_id=rid)  # built in place: one copy of the batch
                entry.batch.MergeFrom(item)
                self._open[rid] = entry
        self.ready.set()

    def take(self) -> cluster_pb2.DecodeStreamResponse:
        msg, self.ready_msg, self._open = self.ready_msg, cluster_pb2.DecodeStreamResponse(), {}
        return msg

    def close(self) -> None:
        for rid in list(self.subscribed):
            self.unsubscribe(rid)

    def drain(self) -> None:
        self.draining = True
        self.ready.set()


def _follows(last: cluster_pb2.TokenBatch, position: int) -> bool:
    """Tokens from `position` on may join `last`: it ends neither the stream (finish, handoff)
    nor before `position`."""
    return not last.finish_reason and not last.handed_off and position == last.start_position + len(last.token_ids)


def _continues(last: cluster_pb2.TokenBatch, item: cluster_pb2.TokenBatch) -> bool:
    """`item` may join `last` in one batch: it follows it, and neither ends the stream by a
    handoff (a finish may join: it is the last one)."""
    return not item.handed_off and _follows(last, item.start_position)


async def serve(sink: Sink, request_iterator):
    """The DecodeStream handler's responses: subscriptions read concurrently; returns once the
    caller stopped writing (or the service drains) and no subscription is left, raises what
    reading raised."""
    reader = asyncio.create_task(_read(sink, request_iterator))
    try:
        while True:
            if not sink.ready_msg.items:
                if reader.done():
                    if reader.exception() is not None:
                        raise reader.exception()
                    if not sink.subscribed:
                        return
                if sink.draining and not sink.subscribed:
                    return
                sink.ready.clear()
                await sink.ready.wait()
                continue
            yield sink.take()
    finally:
        reader.cancel()
        sink.close()


async def _read(sink: Sink, request_iterator) -> None:
    try:
        async for req in request_iterator:
            for rid in req.subscribe:
                sink.subscribe(rid)
            for rid in req.unsubscribe:
                sink.unsubscribe(rid)
    finally:
        sink.ready.set()
