"""`GrpcUpstream`, the gateway's Upstream (upstream_api.py) for a router on another host
(`pddjax serve openai --router`; in the router's own process serving/stack/cohost.RouterUpstream
stands there): one gRPC channel (TLS from the environment, like every client:
serving/security.py), the streaming Generate, grpc.health.v1 and Stats.

The client's `Authorization: Bearer ...` header is passed on as the call's metadata and never
replaced: the router's token is the API key, and a client without one gets the router's
UNAUTHENTICATED (401), even when this process could read the token file itself.
"""

from __future__ import annotations

import json

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pddjax.addresses import host_of, is_loopback
from serving import rpc, security
from serving.pb import router_pb2, router_pb2_grpc

ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


def _metadata(authorization: str | None) -> list[tuple[str, str]]:
    return [("authorization", authorization)] if authorization else []


class GrpcUpstream:
    """The router at `address`, over gRPC (an upstream_api.Upstream)."""

    def __init__(self, address: str):
        if security.tls_dir() is None and not is_loopback(host_of(address)):
            raise security.SecurityConfigError(
                f"the gateway would forward API keys to the router at {address} in plaintext: set "
                f"{security.TLS_DIR_ENV} (a directory with the CA's ca.pem) or run it on the router's host")
        self.address = address
        self.channel: grpc.aio.Channel | None = None

    def open(self) -> None:
        """On the serving event loop (grpc.aio channels belong to the loop that made them)."""
        self.channel = rpc.channel(self.address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    def generate(self, req: router_pb2.GenerateRequest, authorization: str | None, timeout: float | None):
        """The call: iterate it for GenerateResponses; `cancel()` ends it on every tier."""
        return self.stub.Generate(req, timeout=timeout, metadata=_metadata(authorization))

    async def serving(self, timeout: float = 2.0) -> tuple[bool, str]:
        """(the router says SERVING, what it said)."""
        try:
            r = await self.health.Check(health_pb2.HealthCheckRequest(service=ROUTER_SERVICE), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return False, e.code().name.lower()  # not its details: a channel's name the router's address
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        return r.status == health_pb2.HealthCheckResponse.SERVING, name.lower()

    async def stats(self, authorization: str | None, timeout: float = 5.0) -> dict:
        r = await self.stub.Stats(router_pb2.StatsRequest(), timeout=timeout, metadata=_metadata(authorization))
        return json.loads(r.json)
