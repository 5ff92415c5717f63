"""PushKVStream (serving/engine/kv_stream.py): many requests' KV on one stream into the real
DecodeService (tiny model, in process). Requests' chunks interleave; each request is served as
its own PushKV call would be and answered by its own result:

  - interleaved pushes land whole and decode to the monolithic reference's tokens;
  - one request's bad chunk, or a chunk for a request not reserved here, fails that request
    alone (its reservation failed, its pages back); the others on the stream complete;
  - a cancel drops a push (no answer) and a replacement push of the same request completes;
  - the stream's input ending cuts off the pushes still open (answered DATA_LOSS; their
    reservations wait, a later push completes them) and answers those that had their last chunk;
  - a message that does not parse ends the stream INVALID_ARGUMENT and fails the reservations
    that had a push open on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import grpc
import numpy as np
import pytest

from pddjax.engines.reference import ReferenceEngine
from pddjax.model.sampling_params import SamplingParams
from serving import gate, rpc
from serving.engine import kv_stream
from serving.engine.decode import DecodeService
from serving.kvwire import chunks
from serving.pb import cluster_pb2
from tests.support.inprocess import Ctx, engine, prefill_runs, slot_tokens
from tests.support.inprocess import aiter as _aiter

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams()
N = 12  # output tokens


def _prompts(n: int) -> dict[str, list[int]]:
    return {f"r{i}": np.random.default_rng(i).integers(3, 512, 20 + 7 * i).tolist() for i in range(n)}


@contextlib.asynccontextmanager
async def _service(tiny, role: str):
    svc = DecodeService(role, engine(tiny), tiny.config, {"role": rpc.ROLE_NAMES[role]})
    svc.start(asyncio.get_running_loop())
    try:
        yield svc
    finally:
        svc.worker.stop()


async def _reserve(svc, rid: str, prompt: list[int]) -> None:
    spec = cluster_pb2.SequenceSpec(request_id=rid, prompt=prompt, sampling=rpc.sampling_to_pb(GREEDY), max_tokens=N)
    await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=False), Ctx())


def _interleaved(per_request: dict[str, list]) -> list[cluster_pb2.KVStreamRequest]:
    """Round-robin over the requests' chunk lists: r0's first, r1's first, ..., r0's second, ..."""
    out = []
    for group in itertools.zip_longest(*per_request.values()):
        out += [cluster_pb2.KVStreamRequest(chunk=c) for c in group if c is not None]
    return out


async def _results(svc, messages) -> dict[str, cluster_pb2.KVStreamResult]:
    got = {}
    async for res in svc.PushKVStream(_aiter(messages), Ctx()):
        assert res.request_id not in got, f"two results for {res.request_id}"
        got[res.request_id] = res
    return got


async def _gone(svc, rid: str) -> bool:
    """The reservation was failed: out of the table and its sequence gone from the engine."""
    for _ in range(100):
        if rid not in svc.slots:
            break
        await asyncio.sleep(0.01)
    return rid not in svc.slots and not await svc.worker.call(lambda e: rid in e.seqs)


def test_interleaved_pushes_decode_to_the_reference(tiny):
    prompts = _prompts(3)
    ref = ReferenceEngine(tiny.config, tiny.weights)
    want = {rid: ref.generate(p, GREEDY, N, ()).token_ids for rid, p in prompts.items()}
    runs = prefill_runs(tiny, prompts, GREEDY)
    per = {rid: chunks(rid, runs[rid], 0, [want[rid][0]], 1024) for rid in prompts}  # RLD: P's first token
    assert all(len(c) > 2 for c in per.values())

    async def main():
        async with _service(tiny, "relay") as svc:
            for rid, p in prompts.items():
                await _reserve(svc, rid, p)
            slots = {rid: svc.slots.get(rid) for rid in prompts}
            results = await _results(svc, _interleaved(per))
            got = {rid: await slot_tokens(slots[rid]) for rid in prompts}
            await svc.worker.call(lambda e: (e.check_integrity(), svc.slots.check_integrity()))
            return results, got

    results, got = asyncio.run(main())
    assert got == want
    for rid, p in prompts.items():
        r = results[rid]
        assert (r.code, r.done.tokens_imported, r.done.chunks) == (0, len(p), len(per[rid])), r


def test_one_request_s_bad_chunk_fails_it_alone(tiny):
    """r1's second chunk has a wrong checksum; "nobody" is not reserved: each gets its own status,
    r1's reservation is failed; r0 and r2, interleaved with them, complete."""
    prompts = _prompts(3)
    runs = prefill_runs(tiny, prompts, GREEDY)
    per = {rid: chunks(rid, runs[rid], 0, [], 1024) for rid in prompts}
    per["r1"][1].crc32 ^= 1
    per["nobody"] = chunks("nobody", runs["r0"], 0, [], 1024)

    async def main():
        async with _service(tiny, "main") as svc:
            for rid, p in prompts.items():
                await _reserve(svc, rid, p)
            results = await _results(svc, _interleaved(per))
            imported = await svc.worker.call(lambda e: {rid: e.seqs[rid].pages.num_tokens
                                                        for rid in ("r0", "r2")})
            return results, imported, await _gone(svc, "r1")

    results, imported, r1_gone = asyncio.run(main())
    assert results["r1"].code == grpc.StatusCode.DATA_LOSS.value[0], results["r1"]
    assert "checksum" in results["r1"].error and "'r1'" in results["r1"].error
    assert results["nobody"].code == grpc.StatusCode.NOT_FOUND.value[0], results["nobody"]
    assert r1_gone
    assert results["r0"].code == results["r2"].code == 0
    assert imported == {"r0": len(prompts["r0"]), "r2": len(prompts["r2"])}


def test_a_cancel_drops_a_push_and_a_replacement_completes(tiny):
    """r0 sends half its chunks, then a cancel, then all of them again from chunk 0: one result
    (the replacement's), the whole prompt imported; r1 beside it is untouched."""
    prompts = _prompts(2)
    runs = prefill_runs(tiny, prompts, GREEDY)
    c0, c1 = (chunks(rid, runs[rid], 0, [], 1024) for rid in prompts)
    half = len(c0) // 2
    messages = [cluster_pb2.KVStreamRequest(chunk=c) for c in c0[:half]]
    messages += [cluster_pb2.KVStreamRequest(cancel="r0")]
    messages += _interleaved({"r0": c0, "r1": c1})

    async def main():
        async with _service(tiny, "main") as svc:
            for rid, p in prompts.items():
                await _reserve(svc, rid, p)
            results = await _results(svc, messages)
            return results, await svc.worker.call(lambda e: {rid: e.seqs[rid].pages.num_tokens for rid in prompts})

    results, imported = asyncio.run(main())
    assert set(results) == {"r0", "r1"} and results["r0"].code == results["r1"].code == 0
    assert results["r0"].done.chunks == len(c0)
    assert imported == {rid: len(p) for rid, p in prompts.items()}


def test_the_stream_ending_cuts_off_open_pushes_which_a_later_push_completes(tiny):
    prompts = _prompts(2)
    runs = prefill_runs(tiny, prompts, GREEDY)
    c0, c1 = (chunks(rid, runs[rid], 0, [], 1024) for rid in prompts)
    messages = _interleaved({"r0": c0[:len(c0) // 2], "r1": c1})

    async def main():
        async with _service(tiny, "main") as svc:
            for rid, p in prompts.items():
                await _reserve(svc, rid, p)
            first = await _results(svc, messages)
            waiting = "r0" in svc.slots and not svc.slots.get("r0").closed
            second = await _results(svc, [cluster_pb2.KVStreamRequest(chunk=c) for c in c0])
            return first, waiting, second, await svc.worker.call(lambda e: e.seqs["r0"].pages.num_tokens)

    first, waiting, second, r0_tokens = asyncio.run(main())
    assert first["r1"].code == 0
    assert first["r0"].code == grpc.StatusCode.DATA_LOSS.value[0] and "before its last chunk" in first["r0"].error
    assert waiting
    assert second["r0"].code == 0 and r0_tokens == len(prompts["r0"])


def test_a_malformed_message_ends_the_stream_and_fails_its_open_pushes(tiny):
    """The gate refuses bytes that do not parse (gate.MalformedRequest, raised through the stream's
    iterator; the gate then aborts the call INVALID_ARGUMENT): r0, its push open, is failed; r1,
    answered before, keeps its KV."""
    class AbortingCtx:
        code = None

        async def abort(self, code, message):
            self.code = code
            raise grpc.aio.AbortError()

    prompts = _prompts(2)
    runs = prefill_runs(tiny, prompts, GREEDY)
    c0, c1 = (chunks(rid, runs[rid], 0, [], 1024) for rid in prompts)
    malformed = gate._safe_parser(cluster_pb2.KVStreamRequest)(b"\xff\xff")
    assert isinstance(malformed, gate._Malformed)

    async def main():
        async with _service(tiny, "main") as svc:
            for rid, p in prompts.items():
                await _reserve(svc, rid, p)
            slot0, ctx, got = svc.slots.get("r0"), AbortingCtx(), []

            async def messages():
                for c in c1:
                    yield cluster_pb2.KVStreamRequest(chunk=c)
                yield cluster_pb2.KVStreamRequest(chunk=c0[0])
                for _ in range(200):  # r1 answered before the bad message
                    if got:
                        break
                    await asyncio.sleep(0.01)
                yield malformed

            with pytest.raises(gate.MalformedRequest) as refused:  # the gate aborts the call with it
                async for res in svc.PushKVStream(gate._checked_iter(messages(), ctx), ctx):
                    got.append(res)
            ended = await asyncio.wait_for(slot0.out.get(), 5)
            return refused.value.message, got, ended, await _gone(svc, "r0"), await svc.worker.call(
                lambda e: e.seqs["r1"].pages.num_tokens)

    why, got, ended, r0_gone, r1_tokens = asyncio.run(main())
    assert "not a valid KVStreamRequest" in why
    assert ended.code == grpc.StatusCode.INVALID_ARGUMENT and "KVStreamRequest" in ended.message
    assert r0_gone
    assert [r.request_id for r in got] == ["r1"] and got[0].code == 0 and r1_tokens == len(prompts["r1"])


def test_a_full_feed_holds_the_reader_until_its_push_takes_a_chunk():
    async def main():
        feed = kv_stream._Feed()
        for i in range(kv_stream.FEED_CHUNKS):
            await asyncio.wait_for(feed.put(i), 1)
        blocked = asyncio.create_task(feed.put("next"))
        await asyncio.sleep(0.05)
        held = not blocked.done()
        first = await feed.__anext__()
        await asyncio.wait_for(blocked, 1)
        feed.end()
        rest = [x async for x in feed]
        await asyncio.wait_for(feed.put("after the end"), 1)  # dropped, never blocks
        return held, first, rest, list(feed.items)

    held, first, rest, left = asyncio.run(main())
    assert held and first == 0
    assert rest == [*range(1, kv_stream.FEED_CHUNKS), "next"] and left == []


def test_while_the_service_drains_a_new_push_is_refused_and_the_stream_ends_once_idle(tiny):
    """r0's push is open when the service drains: r1's first chunk is answered UNAVAILABLE, r0
    completes, and the stream then ends although P keeps it open (the drain waits for in-flight
    RPCs: an idle stream must not hold it)."""
    prompts = _prompts(2)
    runs = prefill_runs(tiny, prompts, GREEDY)
    c0, c1 = (chunks(rid, runs[rid], 0, [], 1024) for rid in prompts)

    async def main():
        async with _service(tiny, "main") as svc:
            for rid, p in prompts.items():
                await _reserve(svc, rid, p)
            drained, forever = asyncio.Event(), asyncio.Event()

            async def messages():
                yield cluster_pb2.KVStreamRequest(chunk=c0[0])
                await drained.wait()
                yield cluster_pb2.KVStreamRequest(chunk=c1[0])
                for c in c0[1:]:
                    yield cluster_pb2.KVStreamRequest(chunk=c)
                await forever.wait()  # P keeps its stream open

            got = []

            async def read():
                async for res in svc.PushKVStream(messages(), Ctx()):
                    got.append(res)

            reading = asyncio.create_task(read())
            await asyncio.sleep(0.2)
            svc.drain()
            drained.set()
            await asyncio.wait_for(reading, 10)  # ended by the drain, not by P
            return got, await svc.worker.call(lambda e: e.seqs["r0"].pages.num_tokens)

    got, r0_tokens = asyncio.run(main())
    assert [(r.request_id, r.code) for r in got] == [("r1", grpc.StatusCode.UNAVAILABLE.value[0]), ("r0", 0)]
    assert "draining" in got[0].error and r0_tokens == len(prompts["r0"])
