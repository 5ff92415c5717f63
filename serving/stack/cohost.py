"""The OpenAI gateway in the router's process (`pddjax serve router --openai-port N`, what
`pddjax up` runs): router -> `RouterUpstream` -> gateway. `RouterUpstream` is the gateway's
Upstream (serving/openai/upstream_api.py) over the router's in-process entry point
(`RouterService.generate_local`); `start` opens the gateway's HTTP port on the router's loop
(serving/openai/server.start_cohosted) in front of it.

It answers what the router's gRPC port answers, minus the hop:
  - the client's `Authorization` is checked as the port's interceptor checks it
    (security.bearer_refusal: the same token, constant-time compare, the same sentences) ->
    UNAUTHENTICATED (401);
  - then the router's Gate (`Gate.refusal`, the port's own check): loading or draining ->
    UNAVAILABLE (503); /health is ready only once the Gate serves;
  - a deadline: one timer per request; when it fires the request ends with DEADLINE_EXCEEDED
    (504), inside the router's generator as the CancelledError a gRPC deadline raises there, so
    the router releases every tier (its stages see the same deadline);
  - refusals are the router's own statuses (RESOURCE_EXHAUSTED 429, INVALID_ARGUMENT 400, ...),
    raised as the grpc.aio.AioRpcError a gRPC client gets (RouterRefusal);
  - `cancel()` (client gone) ends the router's generator: its cancel path releases every tier
    and counts the request CANCELLED.
The router's messages are its GenerateResponse objects, handed over in memory: nothing is
serialized, written or read per token. The router is reached through public names only: the
Gate's `state`, `refusal()` and `servicer` (the RouterService once ready), and the router's
`generate_local` and `stats`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc

from serving import security
from serving.gate import SERVING, Gate
from serving.openai.server import Cohosted, start_cohosted
from serving.pb import router_pb2

if TYPE_CHECKING:
    from serving.router.service import RouterService

_CLOSING: set[asyncio.Task] = set()  # router generators being closed (referenced until done)


def _status(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class RouterUpstream:
    """The router in this process, behind its Gate (an upstream_api.Upstream)."""

    def __init__(self, gate: Gate, address: str, token: str | None = None):
        """`gate`: the router's Gate (its state; the RouterService as its servicer once ready);
        `address`: the router's gRPC address (named in /v1/models); `token`: the router's bearer
        token (security.router_token()) or None (no key required, as the router)."""
        self.gate, self.address = gate, address
        self._expected = f"Bearer {token}".encode() if token else None

    def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def _refusal(self, authorization: str | None) -> grpc.aio.AioRpcError | None:
        """What the router's port answers before its handler runs (the bearer token, then the Gate), or None."""
        if self._expected is not None:
            refusal = security.bearer_refusal(authorization, self._expected)
            if refusal is not None:
                return _status(grpc.StatusCode.UNAUTHENTICATED, refusal)
        why = self.gate.refusal()
        return None if why is None else _status(grpc.StatusCode.UNAVAILABLE, why)

    def generate(self, req: router_pb2.GenerateRequest, authorization: str | None,
                 timeout: float | None) -> RouterCall:
        refused = self._refusal(authorization)
        router: RouterService = self.gate.servicer  # set once the Gate serves (refused before)
        return RouterCall(_raise(refused) if refused else router.generate_local(req, timeout), timeout)

    async def serving(self, timeout: float = 2.0) -> tuple[bool, str]:
        ok = self.gate.state == SERVING
        return ok, "serving" if ok else "not_serving"

    async def stats(self, authorization: str | None, timeout: float = 5.0) -> dict:
        refused = self._refusal(authorization)
        if refused:
            raise refused
        router: RouterService = self.gate.servicer
        return router.stats()  # this process is the router's host: the full view


async def _raise(error: grpc.aio.AioRpcError):
    raise error
    yield  # pragma: no cover  (makes this an async generator)


class RouterCall:
    """One co-hosted Generate (an upstream_api.Call), iterated by the gateway: the router's
    generator runs in the task that awaits the next message (no queue, nothing per token),
    except right after the first message (the pipeline): the next one is pulled at once in a
    task of its own (`_ahead`), so the router opens the tiers' streams and P starts prefilling as
    soon as it answered, as its gRPC handler does, not when the HTTP response has started (a
    64-request burst: tens of ms)."""

    def __init__(self, messages, timeout: float | None):
        self._messages = messages
        self._waiting: asyncio.Task | None = None  # the task inside __anext__ now
        self._ahead: asyncio.Task | None = None  # the second message, pulled ahead
        self._first = True
        self._expired = self._done = False
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(timeout, self._expire) if timeout is not None else None

    def __aiter__(self) -> RouterCall:
        return self

    async def __anext__(self) -> router_pb2.GenerateResponse:
        if self._expired:
            raise _deadline()
        if self._done:
            raise _status(grpc.StatusCode.CANCELLED, "the call was cancelled")
        step, self._ahead = self._ahead or self._messages.__anext__(), None
        task = self._waiting = asyncio.current_task()
        try:
            msg = await step
        except asyncio.CancelledError:
            self._finish()
            if self._expired and task.uncancel() == 0:  # our deadline, not the caller's own cancel
                raise _deadline() from None
            raise
        except BaseException:  # StopAsyncIteration (the answer ended) or the router's status
            self._finish()
            raise
        finally:
            self._waiting = None
        if self._first:
            self._first = False
            self._ahead = asyncio.ensure_future(self._messages.__anext__())
        return msg

    def _expire(self) -> None:
        self._expired = True
        if self._waiting is not None:
            self._waiting.cancel()  # the router's stages see CancelledError, as a gRPC deadline's
        else:
            self.cancel()

    def cancel(self) -> bool:
        """Ends the request on every tier; False once it had ended."""
        if self._done:
            return False
        if self._waiting is not None:
            self._waiting.cancel()  # __anext__ finishes the call
            return True
        self._finish()
        if self._ahead is not None and not self._ahead.done():
            self._ahead.cancel()  # the router's cancel path runs in that task
            self._ahead.add_done_callback(_retrieved)
            return True
        if self._ahead is not None:
            self._ahead.add_done_callback(_retrieved)
        task = asyncio.ensure_future(self._messages.aclose())  # the router's cancel path, then its release
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)
        return True

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            if self._timer is not None:
                self._timer.cancel()


def _retrieved(task: asyncio.Task) -> None:
    """A pulled-ahead message nobody will read: its outcome is dropped (not logged as never retrieved)."""
    if not task.cancelled():
        task.exception()


def _deadline() -> grpc.aio.AioRpcError:
    return _status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


async def start(gate: Gate, router_address: str, host: str, port: int, model: str | None, token: str | None,
                default_max_tokens: int = 256, request_timeout: float | None = 600.0, **gateway) -> Cohosted:
    """The gateway's HTTP port opened on this (the router's) loop in front of the router behind
    `gate` (503 until it serves); `Cohosted.stop` after the Gate drained. `gateway`:
    start_cohosted's keywords (https, the router's metrics registry and URL)."""
    return await start_cohosted(RouterUpstream(gate, router_address, token), host, port, model,
                                default_max_tokens, request_timeout, **gateway)
