"""The co-host adapter (serving/stack/cohost.py: router -> RouterUpstream -> gateway) and the lean
SSE stream (serving/openai/app.py), against a stand-in router behind a real Gate: no stack, no
engines (~2 s).

  - the bearer token is checked before the router's Gate, with the router port's sentences (401),
    then loading / draining -> UNAVAILABLE (503), the Gate's own sentences;
  - a deadline ends a call waiting on the router with DEADLINE_EXCEEDED, inside the router's
    generator as a CancelledError (its cancel path releases every tier);
  - after the first message the router goes on without waiting for the consumer (as its gRPC
    handler does); cancel() of a call that never streamed ends the router's generator at once;
  - over HTTP (uvicorn + the app, the adapter): keep-alive comments while the router is
    quiet, chunks, `data: [DONE]`; a client that disconnects mid-stream ends the router's generator;
  - the router's drain: a new request 503, /health 503, a stream in flight runs to [DONE];
  - the real RouterService's entry point (no tiers): its refusal is the gateway's 400, its Stats /v1/models'.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from serving.gate import Gate
from serving.openai import app as gateway_app
from serving.openai.answer import Served
from serving.openai.app import Gateway
from serving.openai.server import _listen
from serving.pb import common_pb2, router_pb2
from serving.stack import cohost
from serving.stack.cohost import RouterUpstream

pytestmark = pytest.mark.timeout(60)


class FakeRouter:
    """The router's public entry points: generate_local (the pipeline message, then `tokens` one
    per `gap_s`, or waits forever) and stats."""

    def __init__(self, tokens: int = 3, gap_s: float | None = 0.0):
        self.tokens, self.gap_s = tokens, gap_s
        self.ended: list[str] = []  # how each request's generator ended
        self.reached = 0  # the last request's furthest step: 1 = its first message, 2 = waiting for a token

    async def generate_local(self, req, timeout_s):
        self.reached = 0
        try:
            yield router_pb2.GenerateResponse(request_id="r", pipeline=common_pb2.PIPELINE_PD_LOCAL,
                                              prompt_token_ids=list(req.token_ids.ids))
            self.reached = 1
            for i in range(self.tokens):
                self.reached = 2
                if self.gap_s is None:
                    await asyncio.Event().wait()
                await asyncio.sleep(self.gap_s)
                yield router_pb2.GenerateResponse(token_ids=[10 + i], sources=[common_pb2.ROLE_MAIN], text="x")
            yield router_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                              usage=router_pb2.Usage(prompt_tokens=3, completion_tokens=self.tokens))
            self.ended.append("finished")
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise
        except GeneratorExit:
            self.ended.append("closed")
            raise

    def stats(self) -> dict:
        return {"model": {"name": "fake"}}


def serving_gate(router) -> Gate:
    gate = Gate()
    gate.ready(router)
    return gate


def request():
    from serving.client import make_request

    return make_request([1, 2, 3], max_tokens=2)


async def first_error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in call:
            pass
    return e.value


def test_token_then_gate_then_router():
    async def main():
        router = FakeRouter()
        gate = Gate()  # loading: no servicer yet
        up = RouterUpstream(gate, "127.0.0.1:1", token="sk-t")
        e = await first_error(up.generate(request(), None, None))
        assert (e.code(), e.details()) == (grpc.StatusCode.UNAUTHENTICATED, "this router requires a bearer token")
        e = await first_error(up.generate(request(), "Bearer sk-wrong", None))
        assert (e.code(), e.details()) == (grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        e = await first_error(up.generate(request(), "Bearer sk-t", None))
        assert (e.code(), e.details()) == (grpc.StatusCode.UNAVAILABLE, "the service is loading its model")
        assert await up.serving() == (False, "not_serving")
        gate.ready(router)
        assert await up.serving() == (True, "serving")
        msgs = [m async for m in up.generate(request(), "Bearer sk-t", 5.0)]
        assert [list(m.token_ids) for m in msgs] == [[], [10], [11], [12], []] and router.ended == ["finished"]
        assert await up.stats("Bearer sk-t") == {"model": {"name": "fake"}}
        with pytest.raises(grpc.aio.AioRpcError):
            await up.stats("Bearer sk-wrong")
        gate.drain()
        assert (await first_error(up.generate(request(), "Bearer sk-t", None))).details() == "the service is draining"
        assert await up.serving() == (False, "not_serving")

    asyncio.run(main())


def test_deadline_and_cancel_end_the_routers_generator():
    async def main():
        router = FakeRouter(gap_s=None)  # never sends a token
        up = RouterUpstream(serving_gate(router), "127.0.0.1:1")
        call = up.generate(request(), None, 0.2)
        assert (await anext(call)).pipeline == common_pb2.PIPELINE_PD_LOCAL
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        e = await first_error(call)
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and 0.1 < loop.time() - t0 < 1.0
        assert router.ended == ["cancelled"] and call.cancel() is False  # it had ended
        call = up.generate(request(), None, None)
        await anext(call)  # the router goes on at once (the next message pulled ahead) ...
        await asyncio.sleep(0.05)
        assert router.reached == 2
        assert call.cancel() is True  # ... and the response never started: that pull is cancelled
        await asyncio.sleep(0.05)
        assert router.ended == ["cancelled", "cancelled"] and call.cancel() is False

    asyncio.run(main())


def test_http_stream_pings_while_quiet_and_disconnect_ends_the_router(monkeypatch):
    import aiohttp

    monkeypatch.setattr(gateway_app, "PING_S", 0.1)
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "stream": True, "return_token_ids": True}

    async def main():
        router = FakeRouter(tokens=2, gap_s=0.35)
        gw = Gateway(RouterUpstream(serving_gate(router), "127.0.0.1:1"), Served("m", "x"), check_model=False)
        server, task, address = await _listen(gw, "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://{address}/v1/completions", json=body) as r:
                    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
                    lines = [raw.rstrip(b"\r\n") async for raw in r.content]
                events = [x for x in lines if x]
                first_data = next(i for i, x in enumerate(events) if x.startswith(b"data: "))
                assert events[:first_data] and all(x.startswith(b": ping") for x in events[:first_data]), events
                data = [x[6:] for x in events if x.startswith(b"data: ")]
                assert data[-1] == b"[DONE]"
                ids = [t for d in data[:-1] for c in json.loads(d)["choices"] for t in c.get("token_ids") or []]
                assert ids == [10, 11] and router.ended == ["finished"]
                router.gap_s = None  # the next request waits on the router until the client goes away
                async with s.post(f"http://{address}/v1/completions", json=body) as r:
                    assert r.status == 200
                    await asyncio.sleep(0.15)
                    r.close()
                for _ in range(50):
                    if len(router.ended) == 2:
                        break
                    await asyncio.sleep(0.02)
                assert router.ended == ["finished", "cancelled"] and gw.inflight == 0
        finally:
            server.should_exit = True
            await task

    asyncio.run(main())


def test_cohosted_drain_refuses_new_requests_and_lets_streams_finish():
    """The router's SIGTERM drain (serving/stack/server.py): with its Gate draining a new request is
    503 and /health 503, while a stream in flight runs to [DONE]; `Cohosted.stop` waits for it."""
    import aiohttp

    body = {"model": "any", "prompt": [1, 2, 3], "max_tokens": 3, "stream": True}

    async def main():
        router = FakeRouter(tokens=3, gap_s=0.15)
        gate = serving_gate(router)
        gw = await cohost.start(gate, "127.0.0.1:1", "127.0.0.1", 0, None, None)
        url = f"http://{gw.address}"
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json=body) as r:
                gate.drain()
                async with s.post(url + "/v1/completions", json={**body, "stream": False}) as refused:
                    assert refused.status == 503 and "draining" in (await refused.json())["error"]["message"]
                async with s.get(url + "/health") as h:
                    assert h.status == 503
                stopping = asyncio.ensure_future(gw.stop(10.0))
                lines = [raw.rstrip(b"\r\n") async for raw in r.content]
            assert lines[-2:] == [b"data: [DONE]", b""] and router.ended == ["finished"]
        await asyncio.wait_for(stopping, 10)

    asyncio.run(main())


def test_the_real_routers_entry_point_refuses_and_answers_stats_through_the_gateway():
    """RouterService.generate_local behind its Gate (no tiers started): its INVALID_ARGUMENT is
    the gateway's 400 with the router's sentence; /v1/models reads the router's own Stats."""
    import aiohttp

    from pddjax.model.config import TINY
    from serving.config import RouterSettings
    from serving.router.service import RouterService

    async def main():
        router = RouterService(RouterSettings(prefill=["127.0.0.1:1"], relay=["127.0.0.1:2"], main=["127.0.0.1:3"]),
                               TINY, None)
        gw = await cohost.start(serving_gate(router), "127.0.0.1:1", "127.0.0.1", 0, None, None)
        url = f"http://{gw.address}"
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": 2}) as r:
                    assert r.status == 400, await r.text()
                    assert (await r.json())["error"]["message"] == "model tiny has no tokenizer: send token_ids"
                async with s.get(url + "/v1/models") as r:
                    card = (await r.json())["data"][0]
                assert card["pddjax"]["model"]["name"] == "tiny"
                assert set(card["pddjax"]["healthy_instances"]) == {"prefill", "relay", "main"}
            assert router.counters["requests.failed"] == 0  # refused while validating: nothing reserved
        finally:
            await gw.stop(1.0)

    asyncio.run(main())
