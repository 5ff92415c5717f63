"""Calls (serving/engine/calls.py, serving/call_link.py): unary calls as messages of one stream,
between a real gRPC server holding the real DecodeService (tiny model) and a CallLink:

  - Reserve, MatchPrefix, Release and HandoffTokens answer as their unary RPCs do (values, codes
    and sentences), all on one stream, many at once, each answer to its own call;
  - a call past its timeout raises DEADLINE_EXCEEDED and the server drops it (a Reserve waiting
    for pages leaves no reservation behind);
  - the server going away fails the calls in flight UNAVAILABLE; the next call opens a new stream;
  - a peer without Calls (UNIMPLEMENTED) is called by unary RPCs; so is every peer with
    PDDJAX_CALL_STREAM=0;
  - a draining service answers new calls UNAVAILABLE and ends the stream once idle;
  - with identities (TLS), each call is checked under its own method's row of the table;
  - a call past the stream's bound on calls in flight is refused RESOURCE_EXHAUSTED;
  - a call that names no method, or reuses an id in flight, is refused alone; bytes that do not
    parse end the stream INVALID_ARGUMENT at once, even right behind an answer being written
    (found by the fuzz: the gate's abort from the reader raced the write, and the call hung).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import numpy as np
import pytest

from pddjax.engines.paged_engine import EngineConfig
from pddjax.model.sampling_params import SamplingParams
from serving import rpc
from serving.call_link import CallLink, CallStub
from serving.engine import calls
from serving.engine.decode import DecodeService
from serving.pb import cluster_pb2, cluster_pb2_grpc
from tests.support.inprocess import SMALL, engine

pytestmark = pytest.mark.timeout(120)


def _spec(rid: str, n: int = 20, max_tokens: int = 8) -> cluster_pb2.SequenceSpec:
    prompt = np.random.default_rng(len(rid)).integers(3, 512, n).tolist()
    return cluster_pb2.SequenceSpec(request_id=rid, prompt=prompt, sampling=rpc.sampling_to_pb(SamplingParams()),
                                    max_tokens=max_tokens)


@contextlib.asynccontextmanager
async def _server(tiny, role: str = "main", cfg: EngineConfig = SMALL, port: int = 0, servicer=None):
    svc = servicer or DecodeService(role, engine(tiny, cfg), tiny.config, {"role": rpc.ROLE_NAMES[role]})
    if servicer is None:
        svc.start(asyncio.get_running_loop())
    server = grpc.aio.server()
    cluster_pb2_grpc.add_DecodeServicer_to_server(svc, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield svc, channel, port, server
    finally:
        await channel.close()
        await server.stop(0)
        if servicer is None:
            svc.worker.stop()


async def _code(aw) -> tuple[grpc.StatusCode, str]:
    try:
        await aw
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_calls_answer_as_their_rpcs_do(tiny):
    async def main():
        async with _server(tiny) as (svc, channel, _, _):
            link = CallLink(channel, "main")
            mux, unary = CallStub(link), cluster_pb2_grpc.DecodeStub(channel)
            got = {}
            for name, stub in (("mux", mux), ("unary", unary)):
                rid = f"{name}-0"
                res = await stub.Reserve(cluster_pb2.ReserveRequest(spec=_spec(rid), use_cache=True), timeout=10)
                again = await _code(stub.Reserve(cluster_pb2.ReserveRequest(spec=_spec(rid)), timeout=10))
                match = await stub.MatchPrefix(cluster_pb2.MatchPrefixRequest(page_size=16, page_hashes=[1, 2]),
                                               timeout=10)
                bad = await _code(stub.HandoffTokens(cluster_pb2.HandoffTokensRequest(
                    request_id=rid, start_position=0, token_ids=[10 ** 6], final=True), timeout=10))
                released = await stub.Release(cluster_pb2.ReleaseRequest(request_id=rid), timeout=10)
                gone = await stub.Release(cluster_pb2.ReleaseRequest(request_id=rid), timeout=10)
                got[name] = (res.cached_tokens, again, match.matched_pages, bad, released.found, gone.found)
            reader = link._reader
            await asyncio.gather(*(mux.Release(cluster_pb2.ReleaseRequest(request_id=f"x{i}")) for i in range(8)))
            same_stream = link._reader is reader and not reader.done()
            await svc.worker.call(lambda e: (e.check_integrity(), svc.slots.check_integrity()))
            await link.close()
            return got, same_stream

    got, same_stream = asyncio.run(main())
    mux, unary = got["mux"], got["unary"]
    assert mux[0] == unary[0] == 0
    assert mux[1][0] == unary[1][0] == grpc.StatusCode.ALREADY_EXISTS
    assert mux[1][1] == unary[1][1].replace("unary-0", "mux-0")
    assert mux[2] == unary[2] == 0
    assert mux[3][0] == unary[3][0] == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in mux[3][1]
    assert mux[4:] == unary[4:] == (True, False)
    assert same_stream


def test_many_calls_at_once_each_get_their_own_answer(tiny):
    """40 Reserves and Releases in flight together on one stream: each answer is its own call's
    (found for the reserved ids only, ALREADY_EXISTS for the second Reserve of each)."""
    async def main():
        async with _server(tiny, cfg=EngineConfig(page_size=16, num_pages=256, max_step_tokens=64, max_rows=4,
                                                  attention="xla")) as (svc, channel, _, _):
            stub = CallStub(CallLink(channel))
            rids = [f"r{i}" for i in range(10)]
            await asyncio.gather(*(stub.Reserve(cluster_pb2.ReserveRequest(spec=_spec(r, n=5)), timeout=10)
                                   for r in rids))
            twice = [stub.Reserve(cluster_pb2.ReserveRequest(spec=_spec(r, n=5)), timeout=10) for r in rids]
            others = [f"no{i}" for i in range(10)]
            found = [stub.Release(cluster_pb2.ReleaseRequest(request_id=r)) for r in rids + others]
            codes = await asyncio.gather(*(_code(c) for c in twice))
            res = await asyncio.gather(*found)
            return codes, [r.found for r in res]

    codes, found = asyncio.run(main())
    assert [c for c, _ in codes] == [grpc.StatusCode.ALREADY_EXISTS] * 10
    assert all(f"request r{i} is already reserved" in m for i, (_, m) in enumerate(codes))
    assert found == [True] * 10 + [False] * 10


def test_a_call_past_its_timeout_is_dropped_by_the_server(tiny):
    """A Reserve that queues for pages (the pool full) with a 0.3 s timeout: DEADLINE_EXCEEDED for
    the caller; the server cancels it (no reservation left, nothing queued)."""
    cfg = EngineConfig(page_size=16, num_pages=4, max_step_tokens=64, max_rows=4, attention="xla")

    async def main():
        async with _server(tiny, cfg=cfg) as (svc, channel, _, _):
            stub = CallStub(CallLink(channel))
            await stub.Reserve(cluster_pb2.ReserveRequest(spec=_spec("big", n=40)), timeout=10)  # 3 of 3 pages
            waited = await _code(stub.Reserve(cluster_pb2.ReserveRequest(spec=_spec("late", n=20),
                                                                         wait_for_pages=True), timeout=0.3))
            for _ in range(100):
                if not len(svc.pages):
                    break
                await asyncio.sleep(0.01)
            return waited, "late" in svc.slots, len(svc.pages)

    (code, _), reserved, queued = asyncio.run(main())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not reserved and queued == 0


def test_a_call_its_caller_cancels_is_cancelled_on_the_server(tiny):
    """No timeout: the caller's task is cancelled while its Reserve queues for pages; the cancel
    message reaches the server, which drops the queued Reserve."""
    cfg = EngineConfig(page_size=16, num_pages=4, max_step_tokens=64, max_rows=4, attention="xla")

    async def main():
        async with _server(tiny, cfg=cfg) as (svc, channel, _, _):
            stub = CallStub(CallLink(channel))
            await stub.Reserve(cluster_pb2.ReserveRequest(spec=_spec("big", n=40)), timeout=10)
            task = asyncio.ensure_future(stub.Reserve(cluster_pb2.ReserveRequest(spec=_spec("late", n=20),
                                                                                  wait_for_pages=True)))
            for _ in range(100):
                if len(svc.pages):
                    break
                await asyncio.sleep(0.01)
            queued = len(svc.pages)
            task.cancel()
            for _ in range(200):
                if not len(svc.pages):
                    break
                await asyncio.sleep(0.01)
            return queued, len(svc.pages), "late" in svc.slots

    assert asyncio.run(main()) == (1, 0, False)


def test_a_broken_stream_fails_its_calls_unavailable_and_the_next_call_reconnects(tiny):
    async def main():
        cfg = EngineConfig(page_size=16, num_pages=4, max_step_tokens=64, max_rows=4, attention="xla")
        async with _server(tiny, cfg=cfg) as (svc, channel, port, server):
            link = CallLink(channel, "main")
            stub = CallStub(link)
            await stub.Reserve(cluster_pb2.ReserveRequest(spec=_spec("big", n=40)), timeout=10)
            waiting = asyncio.ensure_future(_code(stub.Reserve(cluster_pb2.ReserveRequest(
                spec=_spec("late", n=20), wait_for_pages=True), timeout=30)))
            await asyncio.sleep(0.3)
            await server.stop(0)
            broken = await asyncio.wait_for(waiting, 10)
            async with _server(tiny, port=port, servicer=svc):
                after = await stub.Release(cluster_pb2.ReleaseRequest(request_id="big"), timeout=10)
            await link.close()
            return broken, after.found

    (code, details), found = asyncio.run(main())
    assert code == grpc.StatusCode.UNAVAILABLE and "Calls stream to main" in details
    assert found


def test_a_peer_without_calls_gets_unary_rpcs(tiny, monkeypatch):
    class Old(cluster_pb2_grpc.DecodeServicer):  # Calls answers UNIMPLEMENTED (the base class)
        async def Release(self, request, context):
            return cluster_pb2.ReleaseResponse(found=request.request_id == "known")

    async def main():
        async with _server(tiny, servicer=Old()) as (_, channel, _, _):
            link = CallLink(channel)
            first = await CallStub(link).Release(cluster_pb2.ReleaseRequest(request_id="known"), timeout=10)
            second = await CallStub(link).Release(cluster_pb2.ReleaseRequest(request_id="other"), timeout=10)
            return first.found, second.found, link.unsupported

    assert asyncio.run(main()) == (True, False, True)


def test_call_stream_off_sends_unary_rpcs(tiny, monkeypatch):
    monkeypatch.setenv("PDDJAX_CALL_STREAM", "0")

    async def main():
        async with _server(tiny) as (_, channel, _, _):
            link = CallLink(channel)
            res = await CallStub(link).Release(cluster_pb2.ReleaseRequest(request_id="x"), timeout=10)
            return res.found, link._reader

    assert asyncio.run(main()) == (False, None)


class _StreamCtx:
    """A Calls stream's context: its peer's identity (a SPIFFE ID names a role) or none."""

    def __init__(self, role: str | None = None):
        self.ids = {"peer_spiffe_id": [f"spiffe://pddjax/role/{role}".encode()]} if role else {}

    def auth_context(self):
        return self.ids


async def _answers(svc, role, ctx, messages, n):
    stream = calls.CallStream(svc, role, ctx)

    async def requests():
        for m in messages:
            yield m
        await asyncio.sleep(0.2)  # the calls' answers first: the input ending does not cancel them

    out = []
    async for res in stream.serve(requests()):
        if not out:
            assert res == cluster_pb2.CallResult(id=0), res  # first: the stream is served
        out.append(res)
        if len(out) == n + 1:
            break
    return {r.id: r for r in out[1:]}


def test_each_call_is_checked_under_its_own_method(tiny):
    """With identities: RLD may send MD HandoffTokens on a Calls stream but not Reserve or
    Release (the router's); without identities (no TLS) nothing is checked."""
    release = cluster_pb2.ReleaseRequest(request_id="x")
    hand = cluster_pb2.HandoffTokensRequest(request_id="x", start_position=0, token_ids=[5], final=True)
    msgs = [cluster_pb2.CallRequest(id=1, release=release), cluster_pb2.CallRequest(id=2, handoff_tokens=hand),
            cluster_pb2.CallRequest(id=3, reserve=cluster_pb2.ReserveRequest(spec=_spec("x")))]

    async def main():
        async with _server(tiny) as (svc, _, _, _):
            relay = await _answers(svc, "main", _StreamCtx("relay"), msgs, 3)
            router = await _answers(svc, "main", _StreamCtx("router"), msgs[:1], 1)
            plain = await _answers(svc, "main", _StreamCtx(), msgs[:1], 1)
            return relay, router, plain

    relay, router, plain = asyncio.run(main())
    denied = grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert relay[1].code == denied and "may not call Release on main" in relay[1].error
    assert relay[3].code == denied and "may not call Reserve on main" in relay[3].error
    assert relay[2].code == grpc.StatusCode.NOT_FOUND.value[0]  # let through: "x" is not reserved here
    assert router[1].code == 0 and plain[1].code == 0


def test_bad_calls_are_refused_alone_and_a_drain_refuses_new_ones(tiny):
    msgs = [cluster_pb2.CallRequest(id=1), cluster_pb2.CallRequest(id=2, timeout_s=-1,
                                                                   release=cluster_pb2.ReleaseRequest()),
            cluster_pb2.CallRequest(id=3, release=cluster_pb2.ReleaseRequest(request_id="y")),
            cluster_pb2.CallRequest(id=4, timeout_s=float("inf"), release=cluster_pb2.ReleaseRequest())]

    async def main():
        async with _server(tiny) as (svc, _, _, _):
            bad = await _answers(svc, "main", _StreamCtx(), msgs, 4)
            stream = calls.CallStream(svc, "main", _StreamCtx())
            stream.drain()
            stream.start(cluster_pb2.CallRequest(id=9, release=cluster_pb2.ReleaseRequest(request_id="y")))
            drained = await asyncio.wait_for(_first(stream.serve(_forever())), 5)
            return bad, drained

    bad, drained = asyncio.run(main())
    assert bad[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "names no method" in bad[1].error
    assert bad[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "bad timeout" in bad[2].error
    assert bad[3].code == 0 and bad[3].release.found is False
    assert bad[4].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "bad timeout" in bad[4].error
    assert drained.code == grpc.StatusCode.UNAVAILABLE.value[0] and "draining" in drained.error


async def _forever():
    await asyncio.Event().wait()
    yield


async def _first(gen):
    """The first result after the stream's own (id 0)."""
    async for item in gen:
        if item.id:
            return item


def test_bytes_that_do_not_parse_end_the_stream_at_once(tiny):
    """Through the gate, as served, from a blocking client as the fuzz sends: an empty call
    (answered INVALID_ARGUMENT) then bytes that are no CallRequest: the stream ends
    INVALID_ARGUMENT within the second, not at the client's deadline."""
    from serving import gate
    from serving.stack.server import SERVICES

    def client(port: int, payload: list[bytes]):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.stream_stream("/pddjax.v1.Decode/Calls", request_serializer=lambda b: b,
                                    response_deserializer=cluster_pb2.CallResult.FromString)
            t0 = time.monotonic()
            try:
                list(call(iter(payload), timeout=10))
                return grpc.StatusCode.OK, time.monotonic() - t0
            except grpc.RpcError as e:
                return e.code(), time.monotonic() - t0

    async def main():
        svc = DecodeService("main", engine(tiny), tiny.config, {"role": rpc.ROLE_NAMES["main"]})
        svc.start(asyncio.get_running_loop())
        server, g = grpc.aio.server(), gate.Gate()
        gate.register(server, SERVICES["main"], g)
        g.ready(svc)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        loop = asyncio.get_running_loop()
        try:
            return [await loop.run_in_executor(None, client, port, payload)
                    for payload in ([b"", b"\x1b!\xa7\x00\x8d\x94?\xba", b"6\xb2\xaa0\xae"], [b"\xff\xff"])]
        finally:
            await server.stop(0)
            svc.worker.stop()

    for code, seconds in asyncio.run(main()):
        assert code == grpc.StatusCode.INVALID_ARGUMENT and seconds < 2, (code, seconds)


def test_calls_past_the_bound_in_flight_are_refused(tiny, monkeypatch):
    """Calls that wait (Reserves queued for pages on a full pool) fill the stream's bound; the next
    is refused RESOURCE_EXHAUSTED at once, and the stream serves again once calls end."""
    monkeypatch.setattr(calls, "MAX_IN_FLIGHT", 3)
    cfg = EngineConfig(page_size=16, num_pages=4, max_step_tokens=64, max_rows=4, attention="xla")

    async def main():
        async with _server(tiny, cfg=cfg) as (svc, channel, _, _):
            stub = CallStub(CallLink(channel))
            await stub.Reserve(cluster_pb2.ReserveRequest(spec=_spec("big", n=40)), timeout=10)
            waiting = [asyncio.ensure_future(_code(stub.Reserve(cluster_pb2.ReserveRequest(
                spec=_spec(f"w{i}", n=20), wait_for_pages=True), timeout=1.5))) for i in range(3)]
            await asyncio.sleep(0.3)
            refused = await _code(stub.Release(cluster_pb2.ReleaseRequest(request_id="x"), timeout=5))
            waited = await asyncio.gather(*waiting)
            after = await stub.Release(cluster_pb2.ReleaseRequest(request_id="big"), timeout=5)
            return refused, [c for c, _ in waited], after.found

    (code, details), waited, found = asyncio.run(main())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "3 calls are already running" in details
    assert waited == [grpc.StatusCode.DEADLINE_EXCEEDED] * 3
    assert found


def test_a_cancelled_call_frees_its_slot_for_the_next_message(tiny, monkeypatch):
    """A cancel frees the call's place in the bound at once: a call sent right after it (the caller
    gave one up on its deadline, then sent another) is served, not refused RESOURCE_EXHAUSTED."""
    monkeypatch.setattr(calls, "MAX_IN_FLIGHT", 1)
    cfg = EngineConfig(page_size=16, num_pages=4, max_step_tokens=64, max_rows=4, attention="xla")
    wait = cluster_pb2.ReserveRequest(spec=_spec("w", n=20), wait_for_pages=True)

    async def main():
        async with _server(tiny, cfg=cfg) as (svc, _, _, _):
            await svc.Reserve(cluster_pb2.ReserveRequest(spec=_spec("big", n=40)), _StreamCtx())
            stream = calls.CallStream(svc, "main", _StreamCtx())
            for msg in (cluster_pb2.CallRequest(id=1, reserve=wait), cluster_pb2.CallRequest(id=1, cancel=True),
                        cluster_pb2.CallRequest(id=2, release=cluster_pb2.ReleaseRequest(request_id="big"))):
                stream.start(msg)  # one after another, with no turn of the loop between them
            answer = await asyncio.wait_for(_first(stream.serve(_forever())), 5)
            stream.drain()
            return answer, dict(stream.tasks)

    answer, left = asyncio.run(main())
    assert answer.id == 2 and answer.code == 0 and answer.release.found, answer
    assert left == {}
