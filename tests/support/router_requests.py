"""Router requests without any service, for tests of `Request` and `stream.Output`: a pdd request
walked to RESERVE or RELAY_STREAMING with stand-in instances, token batches, and Output's
messages while waves of RLD / MD batches reach the request's queue."""

from __future__ import annotations

import asyncio

from serving.pb import cluster_pb2, common_pb2
from serving.router.metrics import RouterMetrics
from serving.router.pools import Instance
from serving.router.request import Request
from serving.router.request_state import State
from serving.router.stream import Output


def walk(r: Request, *states: State) -> Request:
    for s in states:
        r.advance(s)
    return r


def pdd_request() -> Request:
    """A pdd request in RESERVE: P, RLD and the MD of the plan chosen, MD not yet reserved."""
    r = walk(Request(rid="r1", prompt=[5, 6, 7], pipeline=common_pb2.PIPELINE_PDD),
             State.ADMISSION, State.PLAN, State.RESERVE)
    r.prefill, r.relay = Instance("prefill", "p:1"), Instance("relay", "r:1")
    r.main_choice = Instance("main", "m:1")
    return r


def streaming_request() -> Request:
    """The pdd request with MD reserved, its tokens from RLD (RELAY_STREAMING)."""
    r = pdd_request()
    r.main = r.main_choice
    r.main_asked = [r.main]
    return walk(r, State.RELAY_STREAMING)


def batch(start, ids, **kw) -> cluster_pb2.TokenBatch:
    return cluster_pb2.TokenBatch(start_position=start, token_ids=ids, **kw)


async def fed(r: Request, *waves, on_switch=None, on_hold=None, give_up=None) -> list:
    """Output's messages while `waves` of (role, batch) reach the request's queue one after the
    other (each after the stream judged the last); a hang fails within 10 s."""
    async def feed():
        for wave in waves:
            for role, b in wave:
                (r.relay_out if role == "relay" else r.main_out).put_nowait(b)
            await asyncio.sleep(0.05)

    async def read():
        return [m async for m in Output(r, None, [], RouterMetrics(), on_switch, on_hold, give_up).messages()]

    msgs, _ = await asyncio.wait_for(asyncio.gather(read(), feed()), 10)
    return msgs
