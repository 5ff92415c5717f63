"""serving/stack/probes.py: the plaintext health-only port kubelet probes (deploy/) answers the
service port's own grpc.health.v1 statuses and nothing else; a bad port variable is one sentence;
a silent connection is closed after the handshake deadline."""

from __future__ import annotations

import asyncio
import socket
import time

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


def test_silent_connections_to_the_health_port_are_closed_and_probes_still_answer(monkeypatch):
    """Sockets that never speak HTTP/2 are closed after the handshake deadline; meanwhile (fewer of
    them than the connection bound) a probe still gets its answer."""
    monkeypatch.setattr(probes, "HANDSHAKE_SECONDS", 1.0)
    monkeypatch.setattr(probes, "MAX_CONNECTIONS", 16)

    async def run():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        monkeypatch.setenv(probes.HEALTH_PORT_ENV, str(port))
        service = grpc.aio.server()
        names = [SERVICES["main"].full_name]
        hs = rpc.add_health_and_reflection(service, names)
        await rpc.set_serving(hs, names, True)
        health = await probes.open_health_port(hs, "127.0.0.1")
        silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(12)]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                ask = health_pb2.HealthCheckRequest(service=names[0])
                status = (await health_pb2_grpc.HealthStub(ch).Check(ask, timeout=5)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            deadline = time.monotonic() + probes.HANDSHAKE_SECONDS + 3
            still_open = []
            for s in silent:
                s.setblocking(False)
            while silent and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                silent_now = []
                for s in silent:
                    try:
                        if s.recv(65536) != b"":
                            silent_now.append(s)
                    except BlockingIOError:
                        silent_now.append(s)
                    except ConnectionError:
                        pass
                still_open, silent = silent_now, silent_now
            assert not still_open, f"{len(still_open)} silent connections still open past the handshake deadline"
        finally:
            for s in silent:
                s.close()
            await health.stop(0)

    asyncio.run(run())
