"""P's KV push of one request to one target (RLD or MD): the chunks cut from P's exports as its
prefill computes them, in the wire format the router chose for that target (`KVTarget.kv_wire`;
lossy formats encoded off the event loop), sent over the shared PushKVStreams to that address
(kv_link.py) or, with PDDJAX_KV_PUSH_STREAM=0, as one PushKV call of its own -> a TransferDone:
the receiver's status, the encoded and canonical bytes, chunks, the whole time and `wire_ms`
(that time less what the push waited on P's own prefill: what the link estimator learns from).

A push that makes no progress for PDDJAX_PUSH_STALL_SECONDS ends DEADLINE_EXCEEDED (a
blackholed link or a receiver that stopped reading); time waiting on P's prefill is not a stall.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from pddjax import env
from serving import kvwire, rpc
from serving.engine.kv_link import KVLink, stalled
from serving.pb import cluster_pb2, cluster_pb2_grpc


class KVPusher:
    """The pushes of one P: channels, stubs and KV links per target address, made once each.
    `page_size` and `tensor_parallel` are P's engine's (chunk bounds, each shard's heads)."""

    def __init__(self, page_size: int, tensor_parallel: int):
        self.page_size, self.tensor_parallel = page_size, tensor_parallel
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.stubs: dict[str, cluster_pb2_grpc.DecodeStub] = {}
        self.links: dict[str, KVLink] = {}  # the PushKVStreams its pushes share

    async def push(self, rid: str, target: cluster_pb2.KVTarget, q: asyncio.Queue, start: int, end: int,
                   chunk_bytes: int) -> cluster_pb2.TransferDone:
        """Tokens [start, end) of `rid` to `target` as P's prefill exports them into `q` ((KV run
        pieces, first token or None, its TokenLogprob or None) per export) -> its TransferDone."""
        stub = self.stubs.get(target.address)
        if stub is None:  # made once per address: a callable per method
            ch = self.channels[target.address] = rpc.channel(target.address)
            stub = self.stubs[target.address] = cluster_pb2_grpc.DecodeStub(ch)
        chunker = kvwire.Chunker(rid, start, end, chunk_bytes, target.kv_wire or "native", self.page_size,
                                 self.tensor_parallel)  # a TP pool sends each shard's heads
        native = chunker.format.name == "native"  # raw copies; the others encode off the event loop
        waited = [0.0]  # seconds the push waited on P's own prefill (not the link)
        clock = _PushClock()  # the one-call push's no-progress timer (the link keeps its own)

        async def stream():
            while chunker.next_pos < end:
                clock.waiting = True  # on this P's own prefill: not a stall of the link
                w0 = time.perf_counter()
                run, first, first_lp = await q.get()
                waited[0] += time.perf_counter() - w0
                clock.touch()
                known = [first] if first is not None and target.include_first_token else []
                known_lp = [first_lp] if known and first_lp is not None else []
                feed = (run, known, known_lp)
                for c in chunker.feed(*feed) if native else await asyncio.to_thread(chunker.feed, *feed):
                    yield c
                    clock.touch()  # the transport took the chunk

        t0 = time.perf_counter()
        done = cluster_pb2.TransferDone(role=target.role, tokens=end - start)
        stall_s = env.PUSH_STALL_SECONDS.get()
        if env.KV_PUSH_STREAM.get():  # the shared PushKVStream to this address (kv_link.py)
            link = self.links.get(target.address)
            if link is None:
                link = self.links[target.address] = KVLink(stub, target.address)
            res = await link.push(rid, stream(), stall_s)
            done.code, done.error = res.code, res.error
        else:  # one PushKV call of its own
            await _push_call(stub.PushKV(stream()), clock, target.address, stall_s, done)
        done.bytes, done.chunks, done.ms = chunker.bytes, chunker.seq, 1e3 * (time.perf_counter() - t0)
        done.native_bytes = chunker.native_bytes
        done.wire_ms = max(0.0, done.ms - 1e3 * waited[0])
        return done

async def _push_call(call, clock: _PushClock, address: str, stall_s: float, done: cluster_pb2.TransferDone) -> None:
    """The push as one PushKV call (`call`), cancelled after `stall_s` without progress."""
    watch = asyncio.create_task(clock.watch(call, stall_s))
    try:
        await call
    except (asyncio.CancelledError, grpc.aio.AioRpcError) as e:
        if clock.stalled:  # a blackholed link or a receiver that stopped reading: bounded
            done.code, done.error = grpc.StatusCode.DEADLINE_EXCEEDED.value[0], stalled(address, stall_s)
        elif isinstance(e, grpc.aio.AioRpcError):
            done.code, done.error = e.code().value[0], e.details() or str(e.code())
        else:
            raise
    finally:
        watch.cancel()


class _PushClock:
    """No-progress timer of one KV push: the transport took no chunk that P had ready, or the
    receiver did not answer after the last one, for `limit` seconds -> the push is cancelled.
    Time spent waiting on P's own prefill does not count. It bounds a stall, not the transfer:
    on a slow link it must exceed what the HTTP/2 window lets be in flight / the link's rate."""

    def __init__(self):
        self.at, self.waiting, self.stalled = time.monotonic(), False, False

    def touch(self) -> None:
        self.at, self.waiting = time.monotonic(), False

    async def watch(self, call, limit: float) -> None:
        while not call.done():
            await asyncio.sleep(min(1.0, limit / 4))
            if not self.waiting and time.monotonic() - self.at > limit:
                self.stalled = True
                call.cancel()
                return
