"""The router's process holds no JAX: started against fake peers, it reads the real model's
facts (config, tokenizer) from the GGUF's metadata, answers a text Generate with the peers'
failure as a clear status, and never imports a tensor library."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

# Runs in a fresh interpreter: this test process has JAX loaded already (conftest).
_SCRIPT = r'''
import asyncio, json, os, sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from serving.config import service_config
from serving.pb import cluster_pb2_grpc, router_pb2, router_pb2_grpc
from serving.client import make_request
from serving.stack.server import serve


async def unavailable(self, request, context):
    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake peer: no engine here")


class FakePrefill(cluster_pb2_grpc.PrefillServicer):
    Info = MatchPrefix = Release = unavailable


class FakeDecode(cluster_pb2_grpc.DecodeServicer):
    Info = MatchPrefix = Reserve = Handoff = HandoffTokens = Release = unavailable


async def peer(servicer, add):
    server = grpc.aio.server()
    add(servicer, server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def main():
    peers = [await peer(FakePrefill(), cluster_pb2_grpc.add_PrefillServicer_to_server),
             await peer(FakeDecode(), cluster_pb2_grpc.add_DecodeServicer_to_server),
             await peer(FakeDecode(), cluster_pb2_grpc.add_DecodeServicer_to_server)]
    stack = {"model": sys.argv[1], "router": {"prefill": peers[0][1], "relay": peers[1][1], "main": peers[2][1]}}
    ready = sys.argv[2]
    task = asyncio.create_task(serve(service_config(stack, "router"), ready))
    while not os.path.exists(ready):
        assert not task.done(), task.exception()
        await asyncio.sleep(0.05)
    address = json.load(open(ready))["address"]
    async with grpc.aio.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        try:
            async for _ in stub.Generate(make_request(text="Hello there", max_tokens=4, pipeline="pdd"), timeout=30):
                pass
            outcome = ("OK", "")
        except grpc.aio.AioRpcError as e:
            outcome = (e.code().name, e.details())
        stats = await stub.Stats(router_pb2.StatsRequest(), timeout=10)
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax", "orbax"))
    print(json.dumps({"outcome": outcome, "heavy": heavy, "stats": len(stats.json)}))
    os._exit(0)


try:
    asyncio.run(main())
except BaseException:
    import traceback
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
'''


def test_router_serves_without_jax(tmp_path):
    out = subprocess.run([sys.executable, "-c", _SCRIPT, "smollm2-135m", str(tmp_path / "ready.json")],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], f"the router imported {result['heavy'][:5]}"
    code, message = result["outcome"]
    assert code == "UNAVAILABLE" and message, result  # the peers' failure, as one sentence
    assert result["stats"] > 0
