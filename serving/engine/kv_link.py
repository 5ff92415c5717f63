"""P's KV link to one decode instance: PushKVStreams (serving/engine/kv_stream.py) that the pushes
of every request to that address share, opened on the first push and again after one broke.

Pushes write their chunks into a stream's short queue that the stream takes in order; a push
blocked on a full queue waits its turn behind the others (asyncio's queue wakes them first come,
first served), so requests' chunks interleave. One stream still carries its chunks in order, and
the transport holds up to a flow-control window of them ahead of a new push's: a push therefore
takes the stream with the least KV unanswered and opens another (up to MAX_STREAMS) when even
that one is busy (BUSY_BYTES), so a small push does not wait behind a large one. Each push waits
for its own `KVStreamResult`.

Stalls (PDDJAX_PUSH_STALL_SECONDS, `stall_s`): messages waiting while the transport took none for
`stall_s` (a blackholed link, a receiver that stopped reading) break the stream, and every push
on it ends DEADLINE_EXCEEDED; a push whose chunks were all taken with no answer for `stall_s`
ends DEADLINE_EXCEEDED alone (its push is cancelled on the receiver). Time a push spends waiting
on P's own prefill for its next chunk is not a stall. A stream that breaks (the peer restarted,
the network) ends every push on it with that status; the next push opens a new one.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator

import grpc

from serving.pb import cluster_pb2

QUEUE_MESSAGES = 2  # chunks handed to a stream and not yet taken by the transport
MAX_STREAMS = 4  # PushKVStreams to one address at most
BUSY_BYTES = 256 << 10  # KV bytes unanswered on a stream past which a push opens another (below MAX_STREAMS)


def stalled(address: str, stall_s: float) -> str:
    """The sentence of a push ended for want of progress."""
    return f"no progress pushing KV to {address} for {stall_s:g} s (PDDJAX_PUSH_STALL_SECONDS)"


class _Stream:
    """One PushKVStream call and the pushes waiting on it (event loop only)."""

    def __init__(self, stub, address: str, stall_s: float):
        self.address, self.stall_s = address, stall_s
        self.out: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_MESSAGES)
        self.waiting: dict[str, asyncio.Future] = {}  # request id -> its KVStreamResult
        self.sent_all: dict[str, float] = {}  # request id -> when its last chunk was taken
        self.taken_at = time.monotonic()  # the transport last took a message
        self.outstanding = 0  # KV bytes queued by pushes not answered yet
        self.senders = 0  # pushes blocked on a full queue
        self.writing = False  # a message handed to the transport and not yet taken
        self.broken: tuple[int, str] | None = None
        self.cancels: collections.deque = collections.deque()  # cancels that found the queue full
        self.call = stub.PushKVStream(self._messages())
        self.tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    async def _messages(self):
        while True:
            if self.cancels:  # never behind a full queue: a lost cancel would leave a push open there
                msg = self.cancels.popleft()
            elif self.out.empty():
                self.writing = False
                msg = await self.out.get()
                self.taken_at = time.monotonic()  # the transport was idle until now, not stalled
            else:
                msg = self.out.get_nowait()
            self.writing = True
            yield msg
            self.taken_at = time.monotonic()  # asked for the next: the transport took this one
            rid = msg.chunk.request_id if msg.HasField("chunk") and msg.chunk.last else None
            if rid in self.waiting:  # (its answer may have come already)
                self.sent_all[rid] = self.taken_at

    async def _read(self) -> None:
        try:
            async for res in self.call:
                fut = self.waiting.pop(res.request_id, None)
                self.sent_all.pop(res.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(res)
            self._break(grpc.StatusCode.UNAVAILABLE.value[0], f"the KV stream to {self.address} ended")
        except grpc.aio.AioRpcError as e:
            self._break(e.code().value[0], e.details() or str(e.code()))
        except asyncio.CancelledError:
            self._break(grpc.StatusCode.CANCELLED.value[0], f"the KV stream to {self.address} was closed")
            raise

    async def _watch(self) -> None:
        """Every quarter of `stall_s` (at most 1 s): a stalled transport breaks the stream; a push
        answered by nobody `stall_s` after its last chunk was taken ends alone."""
        while self.broken is None:
            await asyncio.sleep(min(1.0, self.stall_s / 4))
            now = time.monotonic()
            if (self.writing or self.out.qsize() or self.senders) and now - self.taken_at > self.stall_s:
                self._break(grpc.StatusCode.DEADLINE_EXCEEDED.value[0], stalled(self.address, self.stall_s))
                self.call.cancel()
                return
            for rid, at in list(self.sent_all.items()):
                if now - at > self.stall_s:
                    self._answer(rid, grpc.StatusCode.DEADLINE_EXCEEDED.value[0], stalled(self.address, self.stall_s))
                    self.cancel(rid)

    def _answer(self, rid: str, code: int, error: str) -> None:
        self.sent_all.pop(rid, None)
        fut = self.waiting.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(cluster_pb2.KVStreamResult(request_id=rid, code=code, error=error))

    def _break(self, code: int, error: str) -> None:
        if self.broken is None:
            self.broken = (code, error)
        for rid in list(self.waiting):
            self._answer(rid, *self.broken)

    async def send(self, msg: cluster_pb2.KVStreamRequest) -> bool:
        """Queue one message (waiting for room); False if the stream broke meanwhile."""
        if self.broken is None and not self.out.full() and not self.senders:
            self.out.put_nowait(msg)  # room, and nobody waiting before this push
            return True
        self.senders += 1
        try:
            while self.broken is None:
                try:
                    await asyncio.wait_for(self.out.put(msg), min(1.0, self.stall_s / 4))
                    return True
                except TimeoutError:
                    continue  # re-check: the watch may have broken the stream
            return False
        finally:
            self.senders -= 1

    def cancel(self, rid: str) -> None:
        """Tell the receiver to drop `rid`'s push (before the queued chunks when the queue is full)."""
        self.waiting.pop(rid, None)
        self.sent_all.pop(rid, None)
        if self.broken is None:
            msg = cluster_pb2.KVStreamRequest(cancel=rid)
            try:
                self.out.put_nowait(msg)
            except asyncio.QueueFull:
                self.cancels.append(msg)

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        self.call.cancel()


class KVLink:
    """The PushKVStreams to one address, shared by every push P makes to it: a push takes the
    stream with the least KV unanswered, or opens another (up to MAX_STREAMS) when even that one
    has BUSY_BYTES unanswered, so a small push does not queue behind a large one's window."""

    def __init__(self, stub, address: str):
        self.stub, self.address = stub, address
        self.streams: list[_Stream] = []

    def _pick(self, stall_s: float) -> _Stream:
        self.streams = [st for st in self.streams if st.broken is None]
        st = min(self.streams, key=lambda x: x.outstanding, default=None)
        if st is None or (st.outstanding >= BUSY_BYTES and len(self.streams) < MAX_STREAMS):
            st = _Stream(self.stub, self.address, stall_s)
            self.streams.append(st)
        return st

    async def push(self, rid: str, chunks: AsyncIterator[cluster_pb2.KVChunk],
                   stall_s: float) -> cluster_pb2.KVStreamResult:
        """Send `rid`'s chunks; its result (code 0 and `done`, or a status and sentence)."""
        for st in self.streams:
            if rid in st.waiting:
                st.cancel(rid)  # a repeated push of a request: the old one is given up
        st = self._pick(stall_s)
        fut = asyncio.get_running_loop().create_future()
        st.waiting[rid] = fut
        sent = 0  # this push's bytes counted in st.outstanding
        try:
            async for chunk in chunks:
                n = len(chunk.k) + len(chunk.v) + len(chunk.scales)
                if not await st.send(cluster_pb2.KVStreamRequest(chunk=chunk)):
                    break
                sent += n
                st.outstanding += n
            return await fut
        except asyncio.CancelledError:
            if fut.cancelled() or not fut.done():  # (cancelling this task cancels the future it awaits)
                st.cancel(rid)
            raise
        finally:
            st.outstanding -= sent

    def close(self) -> None:
        for st in self.streams:
            st.close()
        self.streams = []
