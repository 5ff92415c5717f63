"""Fake P, RLD and MD for router tests that need no engine (issue 17: overload, Generate fuzz).

`FakePeers` runs one grpc.aio server per role on an event loop thread of its own. Each answers
health SERVING, `Info` with a plausible pool (1,024 pages of 16 tokens, the tiny model's
shape), `MatchPrefix` with no hit, `Probe` with the bytes received, and `Reserve` with
RESOURCE_EXHAUSTED "fake peer: full": a request that gets past the router's plan ends there,
as with full pools, and nothing is ever reserved. `hold()` makes `MatchPrefix` wait until
`release()`, so the router keeps requests admitted (its slots and queue fill) for as long as a
test needs. `router(...)` starts a real `pddjax serve router` process against them.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from serving.pb import cluster_pb2, cluster_pb2_grpc, common_pb2
from serving.stack.up import Child, spawn, stop_all, wait_ready

ROLES = {"prefill": common_pb2.ROLE_PREFILL, "relay": common_pb2.ROLE_RELAY, "main": common_pb2.ROLE_MAIN}


class _Fake(cluster_pb2_grpc.PrefillServicer, cluster_pb2_grpc.DecodeServicer):
    """Both services' methods (the rest UNIMPLEMENTED); `peers` holds the shared hold/release event."""

    def __init__(self, peers: FakePeers, role: str):
        self.peers, self.role = peers, role

    async def Info(self, request, context):
        return cluster_pb2.ServiceInfo(role=ROLES[self.role], model="tiny", fingerprint="fake", dtype="float32",
                                       page_size=16, num_pages=1024, num_layers=2, num_kv_heads=2, head_dim=16)

    async def MatchPrefix(self, request, context):
        self.peers.matches += 1
        await self.peers.open.wait()
        return cluster_pb2.MatchPrefixResponse(matched_pages=0, matched_tokens=0, page_size=16)

    async def Probe(self, request, context):
        return cluster_pb2.ProbeResponse(bytes_received=len(request.payload))

    async def Reserve(self, request, context):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake peer: full")

    async def Release(self, request, context):
        return cluster_pb2.ReleaseResponse(found=False)


class FakePeers:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.matches = 0  # MatchPrefix calls seen (the router's plan stage reached)
        self.open: asyncio.Event | None = None
        self.servers, self.addr = [], {}
        self._run(self._start())

    def _run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        for role in ROLES:
            server = grpc.aio.server()
            fake = _Fake(self, role)
            if role == "prefill":
                cluster_pb2_grpc.add_PrefillServicer_to_server(fake, server)
            else:
                cluster_pb2_grpc.add_DecodeServicer_to_server(fake, server)
            health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.servers.append(server)
            self.addr[role] = f"127.0.0.1:{port}"

    def hold(self) -> None:
        """From now on MatchPrefix waits (requests stay in the router's plan stage)."""
        self.loop.call_soon_threadsafe(self.open.clear)

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.open.set)

    def router(self, workdir: str, model: str = "tiny", log=None, **settings) -> Child:
        """A `pddjax serve router` process against these peers, ready (its address in `.address`)."""
        cfg = os.path.join(workdir, "fake_router.json")
        with open(cfg, "w") as f:
            json.dump({"model": model, "router": {"prefill": self.addr["prefill"], "relay": self.addr["relay"],
                                                  "main": self.addr["main"], **settings}}, f)
        child = spawn("router", cfg, workdir, log=log)
        try:
            asyncio.run(wait_ready([child], 120))
        except BaseException:
            stop_all([child])
            raise
        return child

    def close(self) -> None:
        self.release()
        for s in self.servers:
            self._run(s.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
