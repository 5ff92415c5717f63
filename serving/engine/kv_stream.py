"""PushKVStream: many requests' PushKV on one gRPC stream. P opens one per RLD / MD instance
(serving/engine/kv_link.py), so a request's KV costs its chunks and one result message, not a
call of its own (call set-up was most of P's per-request gRPC cost).

Each request's chunks (`KVStreamRequest.chunk`, in order; requests interleave freely) feed a push
of their own, served exactly as one PushKV call would be (`KVReceiver.push`: the same checks,
imports and failures), and its end comes back as one `KVStreamResult`: code 0 with what PushKV
answers, or the status and sentence PushKV would have ended with. A failure is that request's
alone; the stream and every other request on it go on, and the rest of its chunks are dropped
(a chunk 0 starts a new push of it, as a new call would). `KVStreamRequest.cancel` drops a
request's push as a cancelled PushKV call would (nothing answered; the reservation stays for a
replacement push). The caller half-closing the stream cuts off every push still open on it
(answered DATA_LOSS, as a call that ended early); the caller going away cancels them (as calls
cancelled); either way their reservations wait for a replacement P. A message that does not parse cannot be told apart
from any request's chunk: the stream ends INVALID_ARGUMENT and fails every reservation that had
a push open on it.

While the service drains, a new push is refused UNAVAILABLE (as a new PushKV call would be) and
the stream ends once no push is open on it.

A request's chunks wait in a feed of at most FEED_CHUNKS; a full feed stops the stream's reader
until its push takes one (flow control back to P, as one call's window would).
"""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING

import grpc

from serving.pb import cluster_pb2

if TYPE_CHECKING:
    from serving.engine.kv_receiver import KVReceiver

FEED_CHUNKS = 8  # chunks of one request read off the stream and not yet taken by its push
ENDED_KEPT = 4096  # requests whose push ended on a stream, remembered so their late chunks are dropped


class _Ended(Exception):
    """What `context.abort` raises for one request's push on a shared stream."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class _RequestContext:
    """The part of a servicer context `KVReceiver.push` uses: its abort ends that push only."""

    async def abort(self, code: grpc.StatusCode, message: str):
        raise _Ended(code, message)


class _Feed:
    """One request's chunks, written by the stream's reader and read by its push (event loop)."""

    def __init__(self):
        self.items: collections.deque = collections.deque()
        self.ended = False
        self._more, self._room = asyncio.Event(), asyncio.Event()
        self._room.set()

    async def put(self, chunk: cluster_pb2.KVChunk) -> None:
        while len(self.items) >= FEED_CHUNKS and not self.ended:
            self._room.clear()
            await self._room.wait()
        if not self.ended:  # a push that ended reads no more (as a call that answered)
            self.items.append(chunk)
            self._more.set()

    def end(self) -> None:
        self.ended = True
        self._more.set()
        self._room.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> cluster_pb2.KVChunk:
        while not self.items:
            if self.ended:
                raise StopAsyncIteration
            self._more.clear()
            await self._more.wait()
        self._room.set()
        return self.items.popleft()


class KVStream:
    """One PushKVStream's pushes (event loop only); `serve` yields its results."""

    def __init__(self, receiver: KVReceiver):
        self.receiver = receiver
        self.pushes: dict[str, tuple[_Feed, asyncio.Task]] = {}  # open pushes by request id
        self.results: asyncio.Queue = asyncio.Queue()  # KVStreamResult, or None: the stream is done
        self.ended: collections.OrderedDict[str, None] = collections.OrderedDict()  # the latest ENDED_KEPT
        self.reading = True
        self.draining = False  # the service drains: no new push; the stream ends once none is open
        self._done = False

    async def serve(self, request_iterator):
        reader = asyncio.create_task(self._read(request_iterator))
        try:
            while True:
                res = await self.results.get()
                if res is None:
                    break
                yield res
            while not self.results.empty():  # refusals queued behind the end
                res = self.results.get_nowait()
                if res is not None:
                    yield res
            if reader.done():
                await reader  # raises what reading raised (a malformed message: INVALID_ARGUMENT)
        finally:
            reader.cancel()
            for _, task in list(self.pushes.values()):
                task.cancel()  # the caller went away: every open push is cut off

    async def _read(self, request_iterator) -> None:
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("item")
                if kind == "chunk":
                    rid = msg.chunk.request_id
                    if rid not in self.pushes:
                        if rid in self.ended and msg.chunk.seq != 0:
                            continue  # the rest of a push that ended (answered): as a call that answered
                        if self.draining:  # as a new PushKV call would be refused
                            self._end(rid)
                            self.results.put_nowait(cluster_pb2.KVStreamResult(
                                request_id=rid, code=grpc.StatusCode.UNAVAILABLE.value[0],
                                error=f"{self.receiver.role} is draining"))
                            continue
                        self._start(rid)
                    await self.pushes[rid][0].put(msg.chunk)
                elif kind == "cancel":
                    open_ = self.pushes.pop(msg.cancel, None)
                    if open_ is not None:
                        open_[1].cancel()
        except grpc.aio.AbortError:  # the gate refused a message that does not parse
            await self._fail_open("a message on the KV stream carrying it is not a valid KVStreamRequest")
            raise
        finally:
            self.reading = False
            for feed, _ in self.pushes.values():
                feed.end()  # a push with its last chunk still to come ends cut off (answered DATA_LOSS)
            self._maybe_done()

    def _start(self, rid: str) -> None:
        feed = _Feed()
        task = asyncio.create_task(self._push(rid, feed))
        self.pushes[rid] = (feed, task)

    async def _push(self, rid: str, feed: _Feed) -> None:
        try:
            done = await self.receiver.push(feed, _RequestContext())
            res = cluster_pb2.KVStreamResult(request_id=rid, done=done)
        except _Ended as e:
            res = cluster_pb2.KVStreamResult(request_id=rid, code=e.code.value[0], error=e.message)
        except asyncio.CancelledError:
            res = None  # cancelled by P or cut off with the stream: nobody waits for an answer
        finally:
            feed.end()
            if self.pushes.get(rid, (None,))[0] is feed:
                del self.pushes[rid]
            self._end(rid)
        if res is not None:
            self.results.put_nowait(res)
        self._maybe_done()

    async def _fail_open(self, why: str) -> None:
        for rid, (feed, task) in list(self.pushes.items()):
            task.cancel()
            feed.end()
            await self.receiver.fail(rid, grpc.StatusCode.INVALID_ARGUMENT, f"{why} (request {rid})")

    def _end(self, rid: str) -> None:
        self.ended[rid] = None
        self.ended.move_to_end(rid)
        if len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    def drain(self) -> None:
        self.draining = True
        self._maybe_done()

    def _maybe_done(self) -> None:
        if (not self.reading or self.draining) and not self.pushes and not self._done:
            self._done = True
            self.results.put_nowait(None)
