"""serving/stack/probes.py: the plaintext health-only port kubelet probes (deploy/) answers the
service port's own grpc.health.v1 statuses and nothing else; a bad port variable is one sentence."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pddjax.errors import UserError
from serving import rpc
from serving.pb import cluster_pb2, cluster_pb2_grpc
from serving.stack import probes
from serving.stack.server import SERVICES


def test_health_port_mirrors_the_service_statuses(monkeypatch):
    async def run():
        with socket.socket() as sock:  # a free port for the health-only server
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        monkeypatch.setenv(probes.HEALTH_PORT_ENV, str(port))
        service = grpc.aio.server()
        names = [SERVICES["prefill"].full_name]
        hs = rpc.add_health_and_reflection(service, names)
        await rpc.set_serving(hs, names, False)
        health = await probes.open_health_port(hs, "127.0.0.1")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                ask = health_pb2.HealthCheckRequest
                seen = [(await stub.Check(ask(service=names[0]), timeout=5)).status]
                await rpc.set_serving(hs, names, True)
                seen.append((await stub.Check(ask(service=names[0]), timeout=5)).status)
                seen.append((await stub.Check(ask(service=""), timeout=5)).status)
                with pytest.raises(grpc.aio.AioRpcError) as e:  # no service RPC on the health port
                    await cluster_pb2_grpc.PrefillStub(ch).Info(cluster_pb2.InfoRequest(), timeout=5)
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await health.stop(0)
        S = health_pb2.HealthCheckResponse
        assert seen == [S.NOT_SERVING, S.SERVING, S.SERVING]

    asyncio.run(run())


def test_unset_is_none_and_a_bad_value_is_one_sentence(monkeypatch):
    monkeypatch.delenv(probes.HEALTH_PORT_ENV, raising=False)
    monkeypatch.delenv(probes.METRICS_PORT_ENV, raising=False)
    assert probes.env_port(probes.HEALTH_PORT_ENV) is None and probes.metrics_port() == 0
    assert asyncio.run(probes.open_health_port(None, "127.0.0.1")) is None
    monkeypatch.setenv(probes.METRICS_PORT_ENV, "90x")
    with pytest.raises(UserError, match="PDDJAX_METRICS_PORT must be a port number"):
        probes.metrics_port()
