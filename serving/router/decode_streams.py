"""The router's side of DecodeStream (serving/engine/decode_stream.py): one stream per RLD / MD
instance carries every request's tokens, one message per engine step instead of one Decode
call per request and one message per token.

`subscribe(inst, rid, q, who, on_error)` -> a `Subscription`, which behaves as `stream.pump`
over a Decode call did: each TokenBatch of the request goes into `q` as it arrives; a status
the request's stream ends with (its RequestTokens.code), or the whole stream breaking, becomes
an `Abort` in `q`, or what `on_error(err, tokens forwarded so far)` makes of it (pdd's RLD:
MD taking over); `cancel()` (the request ended, or moved to MD) unsubscribes. A broken stream
fails every request on it and the next subscription opens a new one.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

import grpc

from serving.pb import cluster_pb2
from serving.router import pools
from serving.router.request import Abort, from_rpc, status

if TYPE_CHECKING:
    from serving.router.pools import Instance


class Subscription:
    """One request's token stream from one tier (duck-types the pump task it replaces: `cancel`, `done`)."""

    def __init__(self, mux: Mux, rid: str, q, who: str, on_error=None):
        self.mux, self.rid, self.q, self.who, self.on_error = mux, rid, q, who, on_error
        self.seen: list[int] = []  # tokens forwarded (on_error's argument)
        self.ended = False
        self.finished = False  # the service sent the request's finish: it closed and freed the request itself
        self.task: asyncio.Task | None = None  # on_error's, when the stream failed

    def cancel(self) -> None:
        if not self.ended:
            self.ended = True
            self.mux.unsubscribe(self)
        if self.task is not None:
            self.task.cancel()

    def done(self) -> bool:
        return self.ended and (self.task is None or self.task.done())

    def deliver(self, item: cluster_pb2.RequestTokens) -> None:
        if item.code:
            code = status(item.code)
            self.fail(Abort(code, item.error or f"{self.who} failed with {code.name}", self.who))
            return
        batch = item.batch
        self.q.put_nowait(batch)
        self.seen += batch.token_ids
        if batch.finish_reason or batch.handed_off:
            self.ended, self.finished = True, bool(batch.finish_reason)
            self.mux.forget(self)

    def fail(self, err: Abort) -> None:
        self.ended = True
        self.mux.forget(self)
        if self.on_error is None:
            self.q.put_nowait(err)
        else:
            self.task = asyncio.create_task(self._recover(err))

    async def _recover(self, err: Abort) -> None:
        self.q.put_nowait(await self.on_error(err, self.seen))


class Mux:
    """One DecodeStream to one instance: subscriptions by request id, their (un)subscribe
    messages written by one writer task (batched), the responses read by one reader task."""

    def __init__(self, inst: Instance):
        self.inst, self.subs = inst, {}
        self.broken = False
        self._subscribe: list[str] = []
        self._holds: list[cluster_pb2.StreamHold | None] = []  # one per `_subscribe`
        self._unsubscribe: list[str] = []
        self._wake = asyncio.Event()
        self.call = pools.stub(inst).DecodeStream()
        self._writer = asyncio.create_task(self._write())
        self._reader = asyncio.create_task(self._read())

    def subscribe(self, rid: str, q, who: str, on_error=None, hold: tuple[int, float] = (1, 0.0)) -> Subscription:
        sub = Subscription(self, rid, q, who, on_error)
        self.subs[rid] = sub
        self._subscribe.append(rid)
        self._holds.append(cluster_pb2.StreamHold(tokens=hold[0], ms=math.ceil(hold[1])) if hold[0] > 1 else None)
        self._wake.set()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if self.subs.get(sub.rid) is sub:
            del self.subs[sub.rid]
            if not self.broken:
                self._unsubscribe.append(sub.rid)
                self._wake.set()

    def forget(self, sub: Subscription) -> None:
        """The service ended this subscription itself (finish, handoff, status)."""
        if self.subs.get(sub.rid) is sub:
            del self.subs[sub.rid]

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                req = cluster_pb2.DecodeStreamRequest(subscribe=self._subscribe, unsubscribe=self._unsubscribe)
                if any(h is not None for h in self._holds):
                    req.subscribe_hold.extend(h or cluster_pb2.StreamHold() for h in self._holds)
                self._subscribe, self._holds, self._unsubscribe = [], [], []
                await self.call.write(req)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the stream broke: the reader fails every subscription

    async def _read(self) -> None:
        err: Abort | None = None
        try:
            async for msg in self.call:
                for item in msg.items:
                    sub = self.subs.get(item.request_id)
                    if sub is not None:
                        sub.deliver(item)
            err = Abort(grpc.StatusCode.UNAVAILABLE, f"{self.inst.name}'s token stream ended", self.inst.role)
        except grpc.aio.AioRpcError as e:
            err = None if e.code() == grpc.StatusCode.CANCELLED else from_rpc(e, self.inst.role)
        finally:
            self.broken = True
            self._writer.cancel()
            if self.inst.decode_stream is self:
                self.inst.decode_stream = None
        subs, self.subs = list(self.subs.values()), {}
        for sub in subs:
            if err is not None:
                sub.fail(Abort(err.code, err.message, sub.who))

    def close(self) -> None:
        self.call.cancel()


def subscribe(inst: Instance, rid: str, q, who: str, on_error=None, hold: tuple[int, float] = (1, 0.0)) -> Subscription:
    """`rid`'s tokens from `inst` into `q` (see the module docstring), over its one DecodeStream;
    `hold` (tokens, ms): the service groups them so (after the first batch; `StreamHold`)."""
    if inst.decode_stream is None:
        inst.decode_stream = Mux(inst)
    return inst.decode_stream.subscribe(rid, q, who, on_error, hold)
