"""A service port serves at most `max_concurrent_rpcs` RPCs at once (serving/stack/server.py,
`listen`): with a bound of 3, three Generate streams held open are served, a fourth is refused
at once with RESOURCE_EXHAUSTED, the three then complete, and once they have ended a new stream
is served again (a bound on RPCs at once, not in total)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from serving.config import ServiceConfig
from serving.pb import router_pb2, router_pb2_grpc
from serving.stack.server import listen

pytestmark = pytest.mark.timeout(60)
BOUND = 3


class HeldRouter:
    """Generate sends one message, then holds the stream open until `go` is set."""

    def __init__(self):
        self.go = asyncio.Event()

    async def Generate(self, request, context):
        yield router_pb2.GenerateResponse(token_ids=[1])
        await self.go.wait()
        yield router_pb2.GenerateResponse(token_ids=[2])


def test_the_stream_past_the_bound_is_resource_exhausted_and_the_others_complete():
    async def main():
        lst = await listen(ServiceConfig("router", max_concurrent_rpcs=BOUND))
        router = HeldRouter()
        lst.gate.ready(router)
        try:
            async with grpc.aio.insecure_channel(lst.address) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                calls = [stub.Generate(router_pb2.GenerateRequest(), timeout=30) for _ in range(BOUND)]
                for c in calls:  # each one in flight on the server
                    assert list((await c.read()).token_ids) == [1]
                extra = stub.Generate(router_pb2.GenerateRequest(), timeout=3)  # served, it would hold
                refused = (await extra.code(), await extra.details())
                router.go.set()
                done = [list((await c.read()).token_ids) for c in calls]
                ends = [await c.read() for c in calls]  # each stream's end
                codes = [await c.code() for c in calls]
                after = [list(m.token_ids) async for m in stub.Generate(router_pb2.GenerateRequest(), timeout=30)]
                assert all(e is grpc.aio.EOF for e in ends), ends
                return refused, done, codes, after
        finally:
            await lst.server.stop(0)

    (code, details), done, codes, after = asyncio.run(main())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert done == [[2]] * BOUND and codes == [grpc.StatusCode.OK] * BOUND
    assert after == [[1], [2]]


def test_the_default_bound_is_a_few_thousand():
    assert ServiceConfig("main").max_concurrent_rpcs == 4096
