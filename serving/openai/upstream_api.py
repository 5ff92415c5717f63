"""What the gateway needs from a router: `Upstream`, the one thing `app.Gateway` calls, and the
`Call` its `generate` returns.

Two implement it, with the same statuses for the same situations:
  - `upstream.GrpcUpstream`: a router on another host, over one gRPC channel
    (`pddjax serve openai --router`);
  - `serving.stack.cohost.RouterUpstream`: the router in this process (`pddjax serve router
    --openai-port`), through the router's in-process entry point (`RouterService.generate_local`).
A refusal, a deadline or a tier's failure is a grpc.aio.AioRpcError with the router's status and
sentence, raised by `generate`'s iteration or by `stats`, so errors.from_rpc maps both alike:
a missing or wrong bearer token UNAUTHENTICATED, a router loading or draining UNAVAILABLE, the
deadline passed DEADLINE_EXCEEDED, the router's own refusals (RESOURCE_EXHAUSTED,
INVALID_ARGUMENT, ...) as it answers them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from serving.pb import router_pb2


class Call(Protocol):
    """One Generate in flight: iterated for the router's GenerateResponses (the pipeline first,
    then tokens, the last one with finish_reason and usage)."""

    def __aiter__(self) -> AsyncIterator[router_pb2.GenerateResponse]: ...

    def cancel(self) -> bool:
        """Ends the request on every tier (the router releases it); a no-op once it ended."""
        ...


class Upstream(Protocol):
    address: str  # the router's gRPC address (for the operator's logs: no client is shown it)

    def open(self) -> None:
        """Called on the serving event loop before the first request."""
        ...

    async def close(self) -> None:
        """Called when the gateway's app shuts down."""
        ...

    def generate(self, req: router_pb2.GenerateRequest, authorization: str | None, timeout: float | None) -> Call:
        """The call, opened at once; `authorization`: the client's header as is (the router's
        bearer token is the API key); `timeout`: its deadline in seconds (None: the router's default)."""
        ...

    async def serving(self, timeout: float = 2.0) -> tuple[bool, str]:
        """(the router serves, what it said: "serving", "not_serving", an error's name)."""
        ...

    async def stats(self, authorization: str | None, timeout: float = 5.0) -> dict:
        """The router's Stats as a dict (PERMISSION_DENIED off the router's host)."""
        ...
