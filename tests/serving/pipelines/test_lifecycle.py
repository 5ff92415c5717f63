"""Readiness, drain and metrics of one service (issue 8, point 7): NOT_SERVING and UNAVAILABLE
while loading, SIGTERM drains (new RPCs refused, in-flight ones finish), a Prometheus endpoint
whose pddjax_kv_pages_active returns to 0 when idle.

Drain with real requests in flight (issue 17), on a tiny stack: SIGTERM to the router while a
400-token request streams and another waits for its KV, and to RLD while it streams a
400-token request (P and RLD driven as the router would). New RPCs get UNAVAILABLE
"draining" and health NOT_SERVING; every in-flight request finishes with all its tokens,
token-exact; the service exits 0; then no tier holds a request or a page (well within the
60 s reservation lease, so a release that never happened cannot pass)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pddjax.engines.reference import ReferenceEngine
from pddjax.model.sampling_params import SamplingParams
from serving import rpc
from serving.client import Client, RouterError, make_request
from serving.gate import Gate, gated_servicer
from serving.metrics import ServiceMetrics
from serving.pb import cluster_pb2, cluster_pb2_grpc, common_pb2
from serving.stack import server
from tests.support.paths import ROOT
from tests.support.serving_stack import Stack
from tests.support.stack_checks import assert_idle

pytestmark = pytest.mark.timeout(120)
DECODE = cluster_pb2.DESCRIPTOR.services_by_name["Decode"]


class SlowDecode:
    """Info answers at once; Decode streams three batches slowly."""

    async def Info(self, request, context):
        return cluster_pb2.ServiceInfo(model="fake")

    async def Decode(self, request, context):
        for i in range(3):
            await asyncio.sleep(0.2)
            yield cluster_pb2.TokenBatch(start_position=i, token_ids=[i])


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_gate_loading_serving_draining():
    async def main():
        metrics = ServiceMetrics("main")
        gate = Gate(metrics)
        server = grpc.aio.server()
        hs = rpc.add_health_and_reflection(server, [DECODE.full_name])
        await rpc.set_serving(hs, [DECODE.full_name], False)
        cluster_pb2_grpc.add_DecodeServicer_to_server(gated_servicer(DECODE, gate), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        url = metrics.serve_http()
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub, health = cluster_pb2_grpc.DecodeStub(ch), health_pb2_grpc.HealthStub(ch)

        st = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert st.status != health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Info(cluster_pb2.InfoRequest())
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in e.value.details()

        gate.ready(SlowDecode())
        await rpc.set_serving(hs, [DECODE.full_name], True)
        assert (await stub.Info(cluster_pb2.InfoRequest())).model == "fake"
        st = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert st.status == health_pb2.HealthCheckResponse.SERVING

        call = stub.Decode(cluster_pb2.DecodeRequest(request_id="r"))
        first = await call.read()  # in flight
        gate.drain()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Info(cluster_pb2.InfoRequest())
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        rest = []
        while (b := await call.read()) is not grpc.aio.EOF:
            rest.append(b.start_position)
        assert [first.start_position] + rest == [0, 1, 2]  # the in-flight call finished
        assert await gate.wait_idle(5)

        text = urllib.request.urlopen(url, timeout=5).read().decode()
        assert metric(text, 'pddjax_rpc_total{code="UNAVAILABLE",method="Info"}') == 2
        assert metric(text, 'pddjax_rpc_total{code="OK",method="Decode"}') == 1
        assert metric(text, "pddjax_rpc_inflight") == 0
        await ch.close()
        await server.stop(0)

    asyncio.run(main())


def test_service_metrics_endpoint_and_sigterm(tmp_path):
    """A real `pddjax serve main` (tiny): ready file with a metrics URL, pages active 0 when
    idle, SIGTERM exits cleanly."""
    ready = tmp_path / "ready.json"
    cfg = os.path.join(ROOT, "configs", "tiny.toml")
    proc = subprocess.Popen([sys.executable, "-m", "serving", "serve", "main", "--config", cfg, "--port", "0",
                             "--ready-file", str(ready)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "service did not become ready"
            time.sleep(0.2)
        info = json.loads(ready.read_text())
        with grpc.insecure_channel(info["address"]) as ch:
            assert cluster_pb2_grpc.DecodeStub(ch).Info(cluster_pb2.InfoRequest(), timeout=10).num_pages > 0
        text = urllib.request.urlopen(info["metrics"], timeout=5).read().decode()
        assert metric(text, "pddjax_kv_pages_active") == 0
        assert metric(text, "pddjax_kv_pages_total") > 0
        assert metric(text, 'pddjax_rpc_total{code="OK",method="Info"}') == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- drain with real requests in flight (issue 17) ----------------------------------------
DRAIN_STACK = {"model": "tiny", "platform": "cpu",
               "engine": {"dtype": "float32", "page_size": 16, "num_pages": 256, "max_step_tokens": 128,
                          "max_rows": 8},
               "router": {"chunk_bytes": 4096, "ttft_budget_ms": 1e9}}
LONG = 400  # output tokens: with a 20-token prompt, within the tiny model's 512
IDLE_SECONDS = 5.0  # every tier idle this soon after the drained service exited


@pytest.fixture(scope="module")
def drain_stack(tmp_path_factory):
    s = Stack(DRAIN_STACK, str(tmp_path_factory.mktemp("drain")))
    try:
        yield s
    finally:
        s.close()


def _child(stack, role):
    return next(c for c in stack.children if c.role == role)


def _greedy(tiny, prompt, n):
    return ReferenceEngine(tiny.config, tiny.weights).generate(prompt, SamplingParams(), n, ()).token_ids


def _not_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return st.status == health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.timeout(300)
def test_router_drain_finishes_in_flight_requests_then_every_tier_idle(drain_stack, tiny):
    """A 400-token pd-local request streams and a pd-cross one waits for its KV behind a 3 s
    link when the router gets SIGTERM: new Generate calls are refused, both finish exact, the
    router exits 0 and its releases have run: P, RLD and MD idle."""
    stack, router = drain_stack, _child(drain_stack, "router")
    long_prompt, held_prompt = list(range(7, 27)), list(range(40, 60))
    want_long, want_held = _greedy(tiny, long_prompt, LONG), _greedy(tiny, held_prompt, 16)
    client, streamed, first = Client(router.address), [], threading.Event()

    def on_tokens(msg):
        streamed.append(len(msg.token_ids))
        first.set()

    stack.link.set(latency_ms=3000)  # MD's KV (pd-cross) crosses the link in >= 3 s: the drain lasts that long
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = pool.submit(client.generate, make_request(held_prompt, max_tokens=16, pipeline="pd-cross",
                                                             ignore_eos=True), 120)
            long = pool.submit(client.generate, make_request(long_prompt, max_tokens=LONG, pipeline="pd-local",
                                                             ignore_eos=True), 120, on_tokens)
            assert first.wait(60), "the long request never streamed"
            router.proc.send_signal(signal.SIGTERM)
            at_signal = sum(streamed)
            deadline = time.monotonic() + 10
            while True:  # the signal lands within moments; from then on new calls are refused
                try:
                    Client(router.address).generate(make_request([5, 6, 7], max_tokens=2, pipeline="pd-local"), 10)
                except RouterError as e:
                    if e.code == grpc.StatusCode.UNAVAILABLE and "draining" in str(e):
                        break
                assert time.monotonic() < deadline, "the router did not refuse new requests after SIGTERM"
                time.sleep(0.05)
            assert _not_serving(router.address)
            long_result, held_result = long.result(120), held.result(120)
    finally:
        stack.link.set(latency_ms=0)
        client.close()
    assert at_signal < LONG, "the long request had finished before the signal"
    assert long_result.token_ids == want_long and long_result.finish_reason == "length"
    assert held_result.token_ids == want_held and held_result.pipeline == "pd-cross"
    assert router.proc.wait(timeout=60) == 0
    assert_idle(stack, timeout=IDLE_SECONDS)


@pytest.mark.timeout(300)
def test_relay_drain_finishes_the_stream_frees_its_pages_and_exits(drain_stack, tiny):
    """RLD gets SIGTERM while it streams a 400-token request (reserved, KV pushed by P, Decode
    open). A PushKV the test holds open keeps RLD draining while the test looks: Info is
    refused "draining", health NOT_SERVING, the stream ends with all 400 tokens exact, RLD's
    pddjax_kv_pages_active is 0; once the held call ends RLD exits 0, and P is idle."""
    stack, relay = drain_stack, _child(drain_stack, "relay")
    prompt, rid = list(range(100, 120)), "drain-long"
    want = _greedy(tiny, prompt, LONG)
    release_hold = threading.Event()

    def hold():  # a client stream that sends nothing until told: an in-flight RPC
        release_hold.wait(120)
        yield from ()

    rch, pch = grpc.insecure_channel(relay.address), grpc.insecure_channel(stack.addr["prefill"])
    rld, p = cluster_pb2_grpc.DecodeStub(rch), cluster_pb2_grpc.PrefillStub(pch)
    spec = cluster_pb2.SequenceSpec(request_id=rid, prompt=prompt, max_tokens=LONG)
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            held = pool.submit(lambda: rld.PushKV(hold(), timeout=120))
            rld.Reserve(cluster_pb2.ReserveRequest(spec=spec), timeout=30)
            stream = rld.Decode(cluster_pb2.DecodeRequest(request_id=rid), timeout=120)
            prefill = pool.submit(lambda: list(p.Prefill(cluster_pb2.PrefillRequest(spec=spec, targets=[
                cluster_pb2.KVTarget(address=relay.address, role=common_pb2.ROLE_RELAY, include_first_token=True)]),
                timeout=120)))
            batches = [next(stream)]
            relay.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while True:
                try:
                    rld.Info(cluster_pb2.InfoRequest(), timeout=10)
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.details():
                        break
                assert time.monotonic() < deadline, "RLD did not refuse new RPCs after SIGTERM"
                time.sleep(0.05)
            assert _not_serving(relay.address)
            batches += list(stream)
            toks = [t for b in batches for t in b.token_ids]
            assert len(batches[0].token_ids) < LONG, "the stream had ended before the signal"
            assert toks == want and batches[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert all(ev.transfer_done.code == 0 for ev in prefill.result(60) if ev.HasField("transfer_done"))
            deadline = time.monotonic() + IDLE_SECONDS
            while metric(urllib.request.urlopen(relay.metrics, timeout=5).read().decode(),
                         "pddjax_kv_pages_active") != 0:
                assert time.monotonic() < deadline, "RLD still holds pages after the stream ended"
                time.sleep(0.1)
            assert relay.proc.poll() is None  # still draining: the held call is in flight
            released_at = time.monotonic()
            release_hold.set()
            with pytest.raises(grpc.RpcError):  # an empty KV stream: refused, and the drain completes
                held.result(30)
    finally:
        release_hold.set()
        rch.close()
    assert relay.proc.wait(timeout=60) == 0
    # P's PushKVStream to RLD stays open between requests: idle, it must not hold the drain
    assert time.monotonic() - released_at < server.DRAIN_SECONDS / 2
    info = p.Info(cluster_pb2.InfoRequest(), timeout=10)
    pch.close()
    assert (info.requests, info.pages_active) == (0, 0)
