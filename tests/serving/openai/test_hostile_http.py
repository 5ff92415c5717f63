"""The gateway's HTTP edge read as an attacker would, against a stand-in router (an Upstream in
this file): no stack, no engines, each case a second or less.

  - bodies: a declared 1 GiB body is refused (413) before any of it is read; a chunked body is
    cut at the limit; message and prompt-id counts are bounded (400) before per-item work;
  - connections: a silent socket or a dribbled head is closed after a bounded time; an oversized
    head is 431; past the connection limit a new one gets 503 and is closed;
  - exposure: no router address in /v1/models or an UNAVAILABLE error, no /metrics on the public
    port, every framework error in OpenAI's shape, cache hits told only when the operator opts in;
  - deadlines: request_timeout is capped (1e300 no longer overflows), Infinity is refused;
  - plaintext: the gateway will not carry the router's token in plaintext off loopback; HTTPS serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from serving.openai import app as gateway_app
from serving.openai import edge
from serving.openai.server import https_config, plaintext_problem, start_cohosted
from serving.pb import common_pb2, router_pb2

pytestmark = pytest.mark.timeout(60)

ROUTER_ADDRESS = "10.9.8.7:50051"  # the stand-in's "internal" address: no client may read it
BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}


class FakeCall:
    """One answer: the pipeline, one token, the finish with both caches' hits."""

    def __init__(self):
        self.cancelled = False

    async def __aiter__(self):
        yield router_pb2.GenerateResponse(request_id="r", pipeline=common_pb2.PIPELINE_PDD, explain="hit P 16/20")
        yield router_pb2.GenerateResponse(token_ids=[7], sources=[common_pb2.ROLE_RELAY], text="x")
        yield router_pb2.GenerateResponse(
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=router_pb2.Usage(prompt_tokens=20, completion_tokens=1, cached_on_prefill=16, cached_on_main=16,
                                   kv_bytes_to_main=1234),
            timings=router_pb2.Timings(prefill_ms=3.0, kv_to_main_ms=4.0))

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeUpstream:
    """An upstream_api.Upstream that answers every request with FakeCall (or raises `fail`)."""

    address = ROUTER_ADDRESS

    def __init__(self, fail: Exception | None = None):
        self.fail, self.timeouts = fail, []

    def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def generate(self, req, authorization, timeout):
        self.timeouts.append(timeout)
        if self.fail is not None:
            raise self.fail
        return FakeCall()

    async def serving(self, timeout: float = 2.0):
        return True, "serving"

    async def stats(self, authorization, timeout: float = 5.0) -> dict:
        return {"instances": [{"role": "main", "name": "main0", "address": ROUTER_ADDRESS, "healthy": True}]}


@contextlib.asynccontextmanager
async def gateway(upstream=None, **kw):
    """The gateway (uvicorn + the app, as co-hosted) on a free loopback port -> (base URL, its Cohosted)."""
    gw = await start_cohosted(upstream or FakeUpstream(), "127.0.0.1", 0, None, **kw)
    try:
        yield gw
    finally:
        await gw.stop(0.5)


def run(coro):
    return asyncio.run(coro)


async def exchange(address: str, data: bytes = b"", wait_s: float = 3.0) -> bytes:
    """Send `data` on a new connection, then read until the gateway closes it (within `wait_s`: else fail)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        if data:
            writer.write(data)
            await writer.drain()
        return await asyncio.wait_for(reader.read(-1), wait_s)
    finally:
        writer.close()


def status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def openai_shaped(payload: dict) -> bool:
    return set(payload) == {"error"} and {"message", "type", "param", "code"} <= set(payload["error"])


# ---- bodies -----------------------------------------------------------------------------------
def test_a_declared_huge_body_is_413_before_any_of_it_is_read():
    async def main():
        async with gateway() as gw:
            head = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    f"content-length: {1 << 30}\r\n\r\n").encode()
            status, payload = status_and_json(await exchange(gw.address, head))  # no body sent: no wait for it
            assert status == 413 and openai_shaped(payload) and payload["error"]["code"] == "request_too_large"

    run(main())


def test_a_chunked_body_is_cut_at_the_limit():
    async def main():
        async with gateway() as gw:
            host, port = gw.address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            chunk, sent = b"x" * (256 * 1024), 0
            answer = asyncio.ensure_future(reader.read(-1))
            with contextlib.suppress(ConnectionError):
                while not answer.done() and sent < 4 * edge.MAX_BODY_BYTES:
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await writer.drain()
                    sent += len(chunk)
                    # the server shares this loop: a real pause lets its reads run between chunks
                    # (with sleep(0) the socket buffers took 2x the limit on a loaded machine)
                    await asyncio.sleep(0.001)
            raw = await asyncio.wait_for(answer, 5)
            writer.close()
            status, payload = status_and_json(raw)
            assert status == 413 and openai_shaped(payload)
            assert sent < 2 * edge.MAX_BODY_BYTES  # answered once the limit passed, not after the whole body

    run(main())


def test_message_and_prompt_id_counts_are_bounded_before_any_per_item_work():
    from serving.openai.schemas import MAX_MESSAGES, MAX_PROMPT_IDS

    async def main():
        async with gateway() as gw, httpx.AsyncClient(base_url=f"http://{gw.address}", timeout=10) as c:
            t0 = time.perf_counter()
            chat = {"model": "m", "messages": [{"role": "user", "content": ""}] * 100_000}
            r = await c.post("/v1/chat/completions", json=chat)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            r = await c.post("/v1/chat/completions", json={**chat, "messages": chat["messages"][:MAX_MESSAGES + 1]})
            assert r.status_code == 400 and f"at most {MAX_MESSAGES} messages" in r.json()["error"]["message"]
            r = await c.post("/v1/completions", json={**BODY, "prompt": [1] * (MAX_PROMPT_IDS + 1)})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            r = await c.post("/v1/completions", json={**BODY, "prompt": [[1] * (MAX_PROMPT_IDS + 1)]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            assert time.perf_counter() - t0 < 5.0
            assert gw.gateway.upstream.timeouts == []  # nothing reached the router

    run(main())


# ---- connections ------------------------------------------------------------------------------
def test_a_silent_or_dribbling_connection_is_closed(monkeypatch):
    monkeypatch.setattr(edge, "HEADER_TIMEOUT_S", 0.3)

    async def main():
        async with gateway() as gw:
            t0 = time.monotonic()
            assert await exchange(gw.address, wait_s=3.0) == b""  # connected, sent nothing: closed
            host, port = gw.address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            closed = asyncio.ensure_future(reader.read(-1))
            with contextlib.suppress(ConnectionError):
                for byte in b"GET /health HTTP/1.1\r\nx-slow: " + b"a" * 100:
                    if closed.done():
                        break
                    writer.write(bytes([byte]))
                    await asyncio.sleep(0.02)
            assert await asyncio.wait_for(closed, 3.0) == b""  # a head dribbled past the bound: closed
            writer.close()
            assert time.monotonic() - t0 < 5.0

    run(main())


def test_a_keep_alive_connection_cannot_dribble_its_next_head(monkeypatch):
    monkeypatch.setattr(edge, "HEADER_TIMEOUT_S", 0.3)

    async def main():
        async with gateway() as gw:
            host, port = gw.address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"}"), 3)).startswith(b"HTTP/1.1 200")
            closed = asyncio.ensure_future(reader.read(-1))
            with contextlib.suppress(ConnectionError):
                for _ in range(100):  # blank lines, then nothing: the keep-alive timer was cancelled by the data
                    if closed.done():
                        break
                    writer.write(b"\r\n")
                    await asyncio.sleep(0.05)
            assert await asyncio.wait_for(closed, 3.0) == b""
            writer.close()

    run(main())


def test_an_oversized_head_is_431():
    async def main():
        async with gateway() as gw:
            head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (2 * edge.MAX_HEADER_BYTES) + b"\r\n\r\n"
            status, payload = status_and_json(await exchange(gw.address, head))
            assert status == 431 and openai_shaped(payload)

    run(main())


def test_past_the_connection_limit_a_new_connection_is_refused(monkeypatch):
    monkeypatch.setattr(edge, "MAX_CONNECTIONS", 3)

    async def main():
        async with gateway() as gw:
            host, port = gw.address.rsplit(":", 1)
            held = [await asyncio.open_connection(host, int(port)) for _ in range(3)]
            await asyncio.sleep(0.1)
            status, payload = status_and_json(await exchange(gw.address))
            assert status == 503 and payload["error"]["code"] == "too_many_connections"
            for _, w in held:
                w.close()

    run(main())


# ---- exposure ---------------------------------------------------------------------------------
def test_no_router_address_reaches_a_client():
    from serving.openai.errors import from_rpc
    from serving.openai.upstream import GrpcUpstream

    async def main():
        async with gateway() as gw, httpx.AsyncClient(base_url=f"http://{gw.address}", timeout=10) as c:
            r = await c.get("/v1/models")
            assert r.status_code == 200 and ROUTER_ADDRESS not in r.text and "10.9.8.7" not in r.text
        dead = GrpcUpstream("127.0.0.1:1")  # nothing listens: the channel's error names the address
        dead.open()
        try:
            ok, said = await dead.serving(timeout=2.0)
            assert not ok and "127.0.0.1" not in said
        finally:
            await dead.close()

    run(main())
    e = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                             details="failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.5:50051: "
                                     "Failed to connect to remote host: Connection refused (router.internal:50051)")
    message = from_rpc(e).message
    assert "10.0.0.5" not in message and "router.internal" not in message and "50051" not in message, message


def test_every_framework_error_is_openai_shaped_and_metrics_are_off_the_public_port():
    async def main():
        async with gateway() as gw, httpx.AsyncClient(base_url=f"http://{gw.address}", timeout=10) as c:
            for method, path, body, want in (("GET", "/metrics", None, 404), ("GET", "/nope", None, 404),
                                             ("GET", "/v1/completions", None, 405),
                                             ("POST", "/v1/completions", b"{not json", 400),
                                             ("POST", "/v1/completions", b'{"model": 1}', 400)):
                r = await c.request(method, path, content=body, headers={"content-type": "application/json"})
                assert r.status_code == want and openai_shaped(r.json()), (path, r.status_code, r.text)
        async with gateway(FakeUpstream(fail=RuntimeError("boom at 10.9.8.7"))) as gw:
            async with httpx.AsyncClient(base_url=f"http://{gw.address}", timeout=10) as c:
                r = await c.post("/v1/completions", json=BODY)
                assert r.status_code == 500 and openai_shaped(r.json()) and "10.9.8.7" not in r.text, r.text

    run(main())


@pytest.mark.parametrize("opt_in", [False, True], ids=["default", "opted-in"])
def test_cache_hits_are_told_only_when_the_operator_opts_in(monkeypatch, opt_in):
    from pddjax import env
    from serving.openai.answer import CACHE_FIELDS

    monkeypatch.setenv(env.OPENAI_CACHE_HITS.name, "1" if opt_in else "0")

    async def main():
        async with gateway() as gw, httpx.AsyncClient(base_url=f"http://{gw.address}", timeout=10) as c:
            whole = (await c.post("/v1/completions", json=BODY)).json()
            async with c.stream("POST", "/v1/completions", json={**BODY, "stream": True,
                                                                 "stream_options": {"include_usage": True}}) as r:
                events = [json.loads(line[6:]) async for line in r.aiter_lines()
                          if line.startswith("data: {")]
        return whole, events

    whole, events = run(main())
    usages = [whole["usage"]] + [e["usage"] for e in events if e.get("usage")]
    extensions = [whole["pddjax"]] + [e["pddjax"] for e in events if "pipeline" in e.get("pddjax", {})]
    assert len(usages) == 2 and len(extensions) == 2
    assert {u["prompt_tokens_details"]["cached_tokens"] for u in usages} == {16 if opt_in else 0}
    for ext in extensions:
        assert ext["pipeline"] == "pdd"
        assert (set(CACHE_FIELDS) <= set(ext)) == opt_in and (not set(CACHE_FIELDS) & set(ext)) == (not opt_in)
        if opt_in:
            assert (ext["cached_on_prefill"], ext["cached_on_main"], ext["kv_bytes_to_main"]) == (16, 16, 1234)


# ---- deadlines --------------------------------------------------------------------------------
def test_request_timeout_is_capped_and_infinity_refused():
    async def main():
        up = FakeUpstream()
        async with gateway(up) as gw, httpx.AsyncClient(base_url=f"http://{gw.address}", timeout=10) as c:
            r = await c.post("/v1/completions", json={**BODY, "request_timeout": 1e300})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/completions", json={**BODY, "request_timeout": 30})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/completions", content=b'{"model": "m", "prompt": [1], "request_timeout": Infinity}',
                             headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "request_timeout", r.text
        assert up.timeouts == [gateway_app.MAX_REQUEST_TIMEOUT_S, 30]

    run(main())


# ---- plaintext and HTTPS ----------------------------------------------------------------------
def test_the_routers_token_never_crosses_plaintext_http_off_loopback():
    for insecure in (False, True):
        assert "bearer token" in plaintext_problem("0.0.0.0", insecure, token=True)
        assert plaintext_problem("127.0.0.1", insecure, token=True) is None
        assert plaintext_problem("0.0.0.0", insecure, token=True, https=True) is None
    assert plaintext_problem("0.0.0.0", True, token=False) is None  # the router's own rule: no token, --insecure
    assert "--insecure" in plaintext_problem("0.0.0.0", False, token=False)
    out = subprocess.run([sys.executable, "-m", "serving", "serve", "openai", "--router", "127.0.0.1:1",
                          "--host", "0.0.0.0", "--insecure"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "bearer token" in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_the_gateway_serves_https_with_a_certificate(tmp_path):
    from serving.certs import make_dev_certs

    make_dev_certs(str(tmp_path), ("127.0.0.1", "localhost"), 1)
    https = https_config(str(tmp_path / "router.pem"), str(tmp_path / "router-key.pem"))

    async def main():
        async with gateway(https=https) as gw:
            assert gw.info["url"] == f"https://{gw.address}/v1"
            ca = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
            async with httpx.AsyncClient(verify=ca, timeout=10) as c:
                r = await c.get(f"https://{gw.address}/health")
                assert r.status_code == 200 and r.json()["status"] == "ok"

    run(main())
