"""P's KV link (serving/engine/kv_link.py): the pushes of many requests to one address share one
PushKVStream. Against a real gRPC server whose receiver misbehaves on purpose:

  - concurrent small pushes share one stream, each answered;
  - a small push started behind a large one is answered before the large one ends: it takes a
    second stream (one stream carries its chunks in order, and the transport holds a window of
    the large push's ahead of it);
  - a receiver that stops reading breaks the stream after PDDJAX_PUSH_STALL_SECONDS: the push
    ends DEADLINE_EXCEEDED with a sentence, and the next push opens a new stream that works;
  - a push nobody answers ends DEADLINE_EXCEEDED alone (the receiver is told to drop it); the
    stream goes on serving the next push;
  - a stream the receiver ends with a status ends the pushes on it with that status;
  - a push cancelled on P sends the receiver a cancel of that request, whether it was waiting for
    its answer or blocked on a full queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from serving.engine.kv_link import KVLink
from serving.pb import cluster_pb2, cluster_pb2_grpc

pytestmark = pytest.mark.timeout(60)
OK = 0


class Receiver(cluster_pb2_grpc.DecodeServicer):
    """Answers each request on its last chunk. `stuck`: reads nothing; ids starting "slow" take
    20 ms a chunk ("slowest" 100 ms); "silent" ones are never answered; "abort" ends the stream
    UNAVAILABLE."""

    def __init__(self):
        self.stuck = False
        self.cancels: list[str] = []
        self.chunks: dict[str, int] = {}  # request id -> chunks read
        self.read_before_cancel: dict[str, int] = {}  # request id -> its chunks read when its cancel came
        self.streams = 0

    async def PushKVStream(self, request_iterator, context):
        self.streams += 1
        if self.stuck:
            await asyncio.sleep(3600)
        async for msg in request_iterator:
            if msg.WhichOneof("item") == "cancel":
                self.cancels.append(msg.cancel)
                self.read_before_cancel[msg.cancel] = self.chunks.get(msg.cancel, 0)
                continue
            c = msg.chunk
            self.chunks[c.request_id] = self.chunks.get(c.request_id, 0) + 1
            if c.request_id.startswith("slow"):
                await asyncio.sleep(0.1 if c.request_id.startswith("slowest") else 0.02)
            if c.request_id == "abort":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the receiver is going away")
            if c.last and not c.request_id.startswith("silent"):
                yield cluster_pb2.KVStreamResult(request_id=c.request_id,
                                                 done=cluster_pb2.PushKVResponse(chunks=c.seq + 1))


@contextlib.asynccontextmanager
async def _serving(options=()):
    recv, server = Receiver(), grpc.aio.server(options=list(options))
    cluster_pb2_grpc.add_DecodeServicer_to_server(recv, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=list(options))
    link = KVLink(cluster_pb2_grpc.DecodeStub(channel), f"127.0.0.1:{port}")
    try:
        yield recv, link
    finally:
        link.close()
        await channel.close()
        await server.stop(0)


async def _chunks(rid: str, n: int, size: int, gap_s: float = 0.0):
    for i in range(n):
        if gap_s:
            await asyncio.sleep(gap_s)
        yield cluster_pb2.KVChunk(request_id=rid, seq=i, last=i == n - 1, k=b"\0" * size)


def test_concurrent_small_pushes_share_one_stream():
    async def main():
        async with _serving() as (recv, link):
            results = await asyncio.gather(*(link.push(f"r{i}", _chunks(f"r{i}", 3, 2048, 0.001), 10.0)
                                             for i in range(32)))
            return results, recv.streams

    results, streams = asyncio.run(main())
    assert [r.request_id for r in results] == [f"r{i}" for i in range(32)]
    assert all(r.code == OK and r.done.chunks == 3 for r in results) and streams == 1


def test_a_small_push_behind_a_large_one_is_answered_first():
    async def main():
        async with _serving() as (recv, link):
            done = {}

            async def push(rid, n, size):
                res = await link.push(rid, _chunks(rid, n, size), 10.0)
                done[rid] = (time.perf_counter(), res)

            big = asyncio.create_task(push("slow-big", 40, 16 << 10))  # 40 chunks, >= 0.8 s at 20 ms each
            await asyncio.sleep(0.1)
            await push("slow-small", 1, 1024)
            await big
            return done, recv.streams

    done, streams = asyncio.run(main())
    assert streams == 2
    (t_big, big), (t_small, small) = done["slow-big"], done["slow-small"]
    assert big.code == small.code == OK and (big.done.chunks, small.done.chunks) == (40, 1)
    assert t_small < t_big - 0.3, (t_big - t_small)


def test_a_receiver_that_stops_reading_breaks_the_stream_then_a_new_one_serves():
    async def main():
        async with _serving() as (recv, link):
            recv.stuck = True
            t0 = time.perf_counter()
            stalled = await link.push("r1", _chunks("r1", 64, 256 << 10), 1.0)  # 16 MiB: past any window
            took = time.perf_counter() - t0
            recv.stuck = False
            after = await link.push("r2", _chunks("r2", 2, 1024), 1.0)
            return stalled, took, after, recv.streams

    stalled, took, after, streams = asyncio.run(main())
    assert stalled.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "no progress pushing KV" in stalled.error and "PDDJAX_PUSH_STALL_SECONDS" in stalled.error
    assert 1.0 <= took < 6.0
    assert after.code == OK and streams == 2


def test_waiting_on_p_s_own_prefill_is_not_a_stall():
    """Chunks 1.3 s apart (P's prefill) under a 1 s stall limit: answered."""
    async def main():
        async with _serving() as (_, link):
            return await link.push("r", _chunks("r", 2, 1024, gap_s=1.3), 1.0)

    assert asyncio.run(main()).code == OK


def test_a_push_nobody_answers_ends_alone_and_the_stream_goes_on():
    async def main():
        async with _serving() as (recv, link):
            silent = await link.push("silent-1", _chunks("silent-1", 2, 1024), 1.0)
            streams = list(link.streams)
            other = await link.push("r2", _chunks("r2", 2, 1024), 1.0)
            for _ in range(100):
                if recv.cancels:
                    break
                await asyncio.sleep(0.01)
            return silent, other, link.streams == streams, recv.cancels, recv.streams

    silent, other, same, cancels, streams = asyncio.run(main())
    assert silent.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and "no progress" in silent.error
    assert other.code == OK and same and streams == 1
    assert cancels == ["silent-1"]


def test_a_stream_ended_by_the_receiver_ends_its_pushes_with_that_status():
    async def main():
        async with _serving() as (_, link):
            waiting = asyncio.create_task(link.push("slow-w", _chunks("slow-w", 50, 1024, gap_s=0.01), 5.0))
            await asyncio.sleep(0.1)
            aborted = await link.push("abort", _chunks("abort", 1, 1024), 5.0)
            after = await link.push("r3", _chunks("r3", 1, 1024), 5.0)
            return aborted, await waiting, after

    aborted, waiting, after = asyncio.run(main())
    for res in (aborted, waiting):
        assert res.code == grpc.StatusCode.UNAVAILABLE.value[0] and res.error == "the receiver is going away", res
    assert after.code == OK


def test_a_cancel_goes_ahead_of_a_full_queue():
    """A push blocked on a full queue (the receiver reads slowly, the window is full) is cancelled:
    the cancel is not dropped for want of room but sent before the queued chunks, which are never
    sent. The window stays at grpc's initial 64 KB (no bandwidth-delay probing, which grew it on
    loopback until 64 chunks of 256 KB fitted and the queue never filled), so the queue fills at once
    and the receiver (100 ms a chunk) reaches the cancel after the few chunks already in flight."""
    async def main():
        async with _serving(options=[("grpc.http2.bdp_probe", 0)]) as (recv, link):
            task = asyncio.create_task(link.push("slowest-q", _chunks("slowest-q", 64, 256 << 10), 20.0))
            for _ in range(250):
                await asyncio.sleep(0.02)
                if link.streams and link.streams[0].out.full():
                    break
            full = link.streams[0].out.full()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            after = await link.push("r5", _chunks("r5", 1, 1024), 10.0)  # on another stream, maybe first
            for _ in range(1500):  # the slow stream's reader reaches the cancel
                if recv.cancels:
                    break
                await asyncio.sleep(0.02)
            return full, recv.cancels, recv.read_before_cancel, after

    full, cancels, read_before, after = asyncio.run(main())
    assert full, "the queue never filled"
    assert cancels == ["slowest-q"] and after.code == OK, (cancels, after)
    assert read_before["slowest-q"] < 64, read_before  # the queued chunks were not sent before it


def test_a_push_cancelled_on_p_tells_the_receiver():
    async def main():
        async with _serving() as (recv, link):
            task = asyncio.create_task(link.push("slow-c", _chunks("slow-c", 100, 1024), 5.0))  # queue full
            await asyncio.sleep(0.2)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            after = await link.push("r4", _chunks("r4", 1, 1024), 5.0)
            return recv.cancels, after

    cancels, after = asyncio.run(main())
    assert cancels == ["slow-c"] and after.code == OK
