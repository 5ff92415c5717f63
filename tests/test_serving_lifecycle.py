"""Readiness, drain and metrics of one service (issue 8, point 7): NOT_SERVING and UNAVAILABLE
while loading, SIGTERM drains (new RPCs refused, in-flight ones finish), a Prometheus endpoint
whose pddjax_kv_pages_active returns to 0 when idle."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving import rpc
from serving.gate import Gate, gated_servicer
from serving.metrics import ServiceMetrics
from serving.pb import cluster_pb2, cluster_pb2_grpc

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
    cfg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.toml")
    proc = subprocess.Popen([sys.executable, "-m", "pddjax", "serve", "main", "--config", cfg, "--port", "0",
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
