"""The caller's end of a Calls stream (serving/engine/calls.py): unary calls to one RLD or MD as
messages of one stream kept open per channel.

`CallStub(stub, link)` stands in for a Decode stub: Reserve, MatchPrefix, Release and
HandoffTokens go through the link (awaited as the stub's would be: the response, or a
grpc.aio.AioRpcError with the call's code and sentence); every other method is the stub's own.

`CallLink` opens the stream on first use and sends its calls once the service's first result
(id 0) says it serves the stream. A call is a message with an id, answered by id; one whose
timeout passes is given up with a cancel and raises DEADLINE_EXCEEDED; one the caller cancels
sends a cancel. When the stream ends, every call sent on it and unanswered fails UNAVAILABLE
(the callers' retries treat it as a broken connection) and the next call opens a new stream.
Calls not yet sent (the stream ended before its first result) go as unary RPCs instead, so they
meet the peer's own answer (down: UNAVAILABLE). A service that does not know Calls
(UNIMPLEMENTED: an older peer) gets unary RPCs from then on.
`PDDJAX_CALL_STREAM=0` sends unary RPCs always (the comparison, and a fallback).
"""

from __future__ import annotations

import asyncio
import itertools

import grpc

from pddjax import env
from serving.pb import cluster_pb2, cluster_pb2_grpc

METHODS = {"reserve": "Reserve", "match_prefix": "MatchPrefix", "release": "Release",
           "handoff_tokens": "HandoffTokens"}  # CallRequest's oneof field -> the Decode method it calls


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class CallLink:
    """One Calls stream over `channel` (event-loop thread only)."""

    def __init__(self, channel: grpc.aio.Channel, label: str = ""):
        self.channel, self.label = channel, label
        self.stub = cluster_pb2_grpc.DecodeStub(channel)
        self.unsupported = False  # the peer answered UNIMPLEMENTED: unary calls
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._queue: asyncio.Queue | None = None
        self._reader: asyncio.Task | None = None

    def open(self) -> bool:
        return self._reader is not None and not self._reader.done()

    async def call(self, kind: str, request, timeout: float | None = None):
        if self.unsupported or not env.CALL_STREAM.get():
            return await self._unary(kind, request, timeout)
        if not self.open():
            self._start()
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        self._queue.put_nowait(cluster_pb2.CallRequest(id=call_id, timeout_s=timeout or 0.0, **{kind: request}))
        try:
            if timeout is None:
                answer = await asyncio.shield(fut)
            else:
                answer = await asyncio.wait_for(asyncio.shield(fut), max(timeout, 0.0))
        except TimeoutError:
            self._cancel(call_id)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except asyncio.CancelledError:
            self._cancel(call_id)
            raise
        finally:
            self._pending.pop(call_id, None)
        if answer is _UNSENT:  # the stream ended before it was served: this call as an RPC
            return await self._unary(kind, request, timeout)
        return answer

    def _unary(self, kind: str, request, timeout: float | None):
        return getattr(self.stub, METHODS[kind])(request, timeout=timeout)

    def _cancel(self, call_id: int) -> None:
        if self.open():
            self._queue.put_nowait(cluster_pb2.CallRequest(id=call_id, cancel=True))

    def _start(self) -> None:
        self._queue = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read(self._queue))

    async def _read(self, queue: asyncio.Queue) -> None:
        served, ended = asyncio.Event(), asyncio.Event()

        async def requests():
            waits = [asyncio.ensure_future(served.wait()), asyncio.ensure_future(ended.wait())]
            try:  # nothing is sent before the service says it serves the stream
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            while not ended.is_set():
                msg = await queue.get()
                if msg is None:
                    return
                yield msg

        code, why = grpc.StatusCode.UNAVAILABLE, f"the Calls stream to {self.label or 'the peer'} ended"
        call = self.stub.Calls(requests())
        try:
            async for res in call:
                if res.id == 0:
                    served.set()
                    continue
                fut = self._pending.get(res.id)
                if fut is None or fut.done():
                    continue  # given up (timeout, cancel)
                if res.code:
                    fut.set_exception(rpc_error(_CODES.get(res.code, grpc.StatusCode.UNKNOWN), res.error))
                else:
                    fut.set_result(getattr(res, res.WhichOneof("answer") or "reserve"))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.unsupported = True
            code, why = e.code(), f"the Calls stream to {self.label or 'the peer'} broke: {e.details()}"
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            for fut in list(self._pending.values()):
                if not fut.done():
                    if not served.is_set():
                        fut.set_result(_UNSENT)
                    else:
                        fut.set_exception(rpc_error(code if code != grpc.StatusCode.OK else
                                                    grpc.StatusCode.UNAVAILABLE, why))
            ended.set()  # the request generator returns (grpc's task feeding it ends)
            queue.put_nowait(None)

    async def close(self) -> None:
        if self._queue is not None:
            self._queue.put_nowait(None)
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, grpc.aio.AioRpcError):
                pass


_UNSENT = object()  # a call's answer: the stream ended before any call was sent on it
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class CallStub:
    """A Decode stub whose Reserve, MatchPrefix, Release and HandoffTokens go through `link`."""

    def __init__(self, link: CallLink):
        self._link = link

    def __getattr__(self, name):
        return getattr(self._link.stub, name)

    def Reserve(self, request, timeout=None):  # noqa: N802 (the stub's method names)
        return self._link.call("reserve", request, timeout)

    def MatchPrefix(self, request, timeout=None):  # noqa: N802
        return self._link.call("match_prefix", request, timeout)

    def Release(self, request, timeout=None):  # noqa: N802
        return self._link.call("release", request, timeout)

    def HandoffTokens(self, request, timeout=None):  # noqa: N802
        return self._link.call("handoff_tokens", request, timeout)


class PeerLinks:
    """A Calls stream per peer address, for channels lent by an rpc.PeerChannels (RLD's to MD)."""

    def __init__(self, channels):
        self.channels, self.links = channels, {}

    def stub(self, address: str, channel: grpc.aio.Channel) -> CallStub:
        """`address`'s link over `channel` (a new one when the channel is new); links whose
        channels the PeerChannels closed are dropped."""
        link = self.links.get(address)
        if link is None or link.channel is not channel:
            self.links[address] = link = CallLink(channel, f"MD {address}")
        for gone in [a for a in self.links if a not in self.channels]:
            del self.links[gone]
        return CallStub(link)
