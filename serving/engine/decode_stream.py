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

A subscription may carry its request's stream interval (`StreamHold`: K tokens, a bound in ms):
after its first batch, the request's tokens are held here until K are ready or the oldest waited
the bound, then go as one entry; a finish, a handoff or a status goes at once, with what was held
before it. The caller then reads one entry per K tokens instead of one per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import grpc

from serving.config import MAX_STREAM_INTERVAL, MAX_STREAM_INTERVAL_MS
from serving.engine.slot import RpcFailure
from serving.pb import cluster_pb2

if TYPE_CHECKING:
    from serving.engine.slot import Slot, SlotTable


class Sink:
    """One DecodeStream's subscriptions and the entries ready to send (event-loop thread only)."""

    def __init__(self, slots: SlotTable, role: str, entries_sent=None):
        self.slots, self.role = slots, role
        self.entries_sent = entries_sent  # a Counter of the entries sent (the service's metrics), or None
        self.subscribed: dict[str, Slot] = {}
        self.ready_msg = cluster_pb2.DecodeStreamResponse()  # the entries ready, in arrival order (the next message)
        self._open: dict[str, cluster_pb2.RequestTokens] = {}  # a request's last ready batch (merging)
        self.ready = asyncio.Event()
        self.draining = False  # the service drains: the stream ends once no subscription is left
        self.holds: dict[str, tuple[int, float]] = {}  # a held subscription's (tokens, bound in s; 0: none)
        self.held: dict[str, cluster_pb2.TokenBatch] = {}  # its tokens held, once its first batch went
        self.due: dict[str, float] = {}  # perf_counter by which a held batch must go (a bound set)
        self._started: set[str] = set()  # held subscriptions whose first batch went

    def subscribe(self, rid: str, hold: cluster_pb2.StreamHold | None = None) -> None:
        """`rid`'s stream from here on (what its slot queued first), held per `hold` if given."""
        slot = self.slots.get(rid)
        if slot is None:
            self.refuse(rid, RpcFailure(grpc.StatusCode.NOT_FOUND, f"request {rid} is not reserved on {self.role}"))
            return
        if hold is not None and not (hold.tokens <= MAX_STREAM_INTERVAL and hold.ms <= MAX_STREAM_INTERVAL_MS):
            self.refuse(rid, RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"request {rid}'s stream hold must be 0..{MAX_STREAM_INTERVAL} tokens and "
                                        f"0..{MAX_STREAM_INTERVAL_MS} ms, got {hold.tokens} / {hold.ms}"))
            return
        held = []
        if slot.sink is not None:  # another stream had it: this one takes over, as a second Decode call would
            moved = slot.sink.unsubscribe(rid)
            if moved is not None:
                held.append(moved)
        slot.streams += 1
        self.subscribed[rid] = slot
        if hold is not None and hold.tokens > 1:
            self.holds[rid] = (hold.tokens, hold.ms / 1e3)
        while not slot.out.empty():  # queued before the subscription (no reader yet)
            held.append(slot.out.get_nowait())
        slot.sink = self
        for item in held:
            self.add(slot, item)

    def refuse(self, rid: str, failure: RpcFailure) -> None:
        """A subscription not taken: its stream ends with `failure` at once (no other is touched)."""
        self._append(rid, failure)

    def unsubscribe(self, rid: str) -> cluster_pb2.TokenBatch | None:
        """-> the tokens held for it, not sent (a stream taking the request over sends them)."""
        slot = self.subscribed.pop(rid, None)
        if slot is None:
            return None
        if slot.sink is self:
            slot.sink = None
        slot.streams -= 1
        slot.touched = time.monotonic()
        if self.holds.pop(rid, None) is None:
            return None
        self._started.discard(rid)
        self.due.pop(rid, None)
        return self.held.pop(rid, None)

    def add(self, slot: Slot, item) -> None:
        """An item of a subscribed slot's stream (TokenBatch | RpcFailure); one that ends it ends
        the subscription."""
        rid = slot.request_id
        if rid not in self.subscribed:
            return
        ends = isinstance(item, RpcFailure) or item.finish_reason or item.handed_off
        hold = self.holds.get(rid)
        if hold is not None:
            if not ends and rid in self._started:
                self._hold(rid, item, hold)
                return
            self._started.add(rid)
            if rid in self.held:
                self.release(rid)
        self._append(rid, item)
        if ends:
            self.unsubscribe(rid)

    def add_token(self, rid: str, position: int, token: int) -> None:
        """One token (no logprob, not the last) of a subscribed request: `add` of its one-token
        TokenBatch, written straight into the ready message (or held)."""
        if rid not in self.subscribed:
            return
        hold = self.holds.get(rid)
        if hold is not None:
            if rid in self._started:
                held = self.held.get(rid)
                if held is None or not _follows(held, position):
                    self._hold(rid, cluster_pb2.TokenBatch(start_position=position, token_ids=(token,)), hold)
                    return
                held.token_ids.append(token)
                if len(held.token_ids) >= hold[0]:
                    self.release(rid)
                return
            self._started.add(rid)
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

    def _hold(self, rid: str, item: cluster_pb2.TokenBatch, hold: tuple[int, float]) -> None:
        """`item` (no finish, no handoff) joins the request's held batch; the batch goes once it
        holds `hold`'s tokens."""
        held = self.held.get(rid)
        if held is not None and not _continues(held, item):
            self.release(rid)  # not contiguous (never seen in order): what was held goes first
            held = None
        if held is None:
            held = self.held[rid] = cluster_pb2.TokenBatch()
            held.MergeFrom(item)
            if hold[1]:
                self.due[rid] = time.perf_counter() + hold[1]
                self.ready.set()  # the writer waits for this bound too
        else:
            held.token_ids.extend(item.token_ids)
            held.logprobs.extend(item.logprobs)
        if len(held.token_ids) >= hold[0]:
            self.release(rid)

    def release(self, rid: str) -> None:
        """The request's held batch goes into the ready message."""
        self.due.pop(rid, None)
        self._append(rid, self.held.pop(rid))

    def release_due(self) -> float | None:
        """Sends the held batches whose bound passed -> the next bound (perf_counter), or None."""
        if not self.due:
            return None
        now, nxt = time.perf_counter(), None
        for rid, due in list(self.due.items()):
            if due <= now:
                self.release(rid)
            elif nxt is None or due < nxt:
                nxt = due
        return nxt

    def check_integrity(self) -> None:
        """Every subscribed slot points here; every hold, held batch, bound and started mark
        belongs to a held subscription; a held batch ends nothing and is short of its K.
        AssertionError says what disagrees."""
        for rid, slot in self.subscribed.items():
            assert slot.request_id == rid and slot.sink is self, f"{rid}'s slot is not this stream's subscription"
        stray = set(self.holds) - set(self.subscribed)
        assert not stray, f"holds without a subscription: {stray}"
        assert set(self.held) <= set(self.holds) and self._started <= set(self.holds), "held tokens without a hold"
        assert set(self.due) <= set(self.held), f"bounds without held tokens: {set(self.due) - set(self.held)}"
        for rid, batch in self.held.items():
            assert not batch.finish_reason and not batch.handed_off, f"{rid}'s held batch ends its stream"
            n = len(batch.token_ids)
            assert n < self.holds[rid][0], f"{rid} holds {n} tokens, its K or more"

    def take(self) -> cluster_pb2.DecodeStreamResponse:
        msg, self.ready_msg, self._open = self.ready_msg, cluster_pb2.DecodeStreamResponse(), {}
        return msg

    def close(self) -> None:
        for rid in list(self.subscribed):
            self.unsubscribe(rid)

    def drain(self) -> None:
        self.draining = True
        self.ready.set()


def integrity_error(streams) -> str:
    """Event loop: the first `check_integrity` error among the Sinks in `streams` (a service's
    persistent streams), or ""."""
    try:
        for stream in list(streams):
            if isinstance(stream, Sink):
                stream.check_integrity()
    except AssertionError as e:
        return str(e) or "a DecodeStream's check_integrity failed"
    return ""


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
            due = sink.release_due()
            if not sink.ready_msg.items:
                if reader.done():
                    if reader.exception() is not None:
                        raise reader.exception()
                    if not sink.subscribed:
                        return
                if sink.draining and not sink.subscribed:
                    return
                sink.ready.clear()
                if due is None:
                    await sink.ready.wait()
                else:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(max(0.0, due - time.perf_counter())):
                            await sink.ready.wait()
                continue
            msg = sink.take()
            if sink.entries_sent is not None:
                sink.entries_sent.inc(len(msg.items))
            yield msg
    finally:
        reader.cancel()
        sink.close()


async def _read(sink: Sink, request_iterator) -> None:
    try:
        async for req in request_iterator:
            holds = req.subscribe_hold
            if holds and len(holds) != len(req.subscribe):
                why = f"subscribe_hold must be empty or one per subscribe ({len(holds)} for {len(req.subscribe)})"
                for rid in req.subscribe:
                    sink.refuse(rid, RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, why))
            else:
                for i, rid in enumerate(req.subscribe):
                    sink.subscribe(rid, holds[i] if holds else None)
            for rid in req.unsubscribe:
                sink.unsubscribe(rid)
    finally:
        sink.ready.set()
