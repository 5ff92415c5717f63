"""The co-hosted gateway's upstream: the router's Generate called in the router's own process.

`pddjax serve router --openai-port N` runs the gateway on the router's event loop
(server.start_cohosted); this class stands where `upstream.Upstream` (a gRPC channel) stands
for a gateway on another host, with the same behaviour a gRPC client sees, minus the hop:
  - the client's `Authorization` is checked as the router's gRPC port checks it
    (security.BearerAuth: the same token, constant-time compare, the same sentences) ->
    UNAUTHENTICATED (401);
  - while the router loads or drains (its lifecycle.Gate) -> UNAVAILABLE (503), as the Gate
    answers RPCs; /health is ready only once the Gate serves;
  - a deadline: one timer per request; when it fires the request ends with DEADLINE_EXCEEDED (504)
    and the router releases every tier (its stages see the same deadline);
  - refusals are the router's own statuses (RESOURCE_EXHAUSTED 429, INVALID_ARGUMENT 400, ...),
    raised as the grpc.aio.AioRpcError a gRPC client would get, so errors.from_rpc maps both
    gateways alike;
  - `cancel()` (client gone, the response never started) ends the router's generator: its
    cancel path releases every tier and counts the request CANCELLED.
The router's messages are its GenerateResponse objects, handed over in memory: nothing is
serialized, written or read per token. The router is duck-typed (`gate.servicer` has
`generate_local(request, timeout_s)` and `stats()`), so this package imports no router module.
"""

from __future__ import annotations

import asyncio

import grpc

from serving import security
from serving.gate import LOADING, SERVING, wait_set


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class LocalUpstream:
    def __init__(self, gate, address: str, token: str | None = None):
        """`gate`: the router's serving/gate.Gate (its state; its servicer once ready);
        `address`: the router's gRPC address (named in /v1/models); `token`: the router's bearer
        token (security.router_token()) or None (no key required, as the router)."""
        self.gate, self.address = gate, address
        self._expected = f"Bearer {token}".encode() if token else None
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing: set[asyncio.Task] = set()

    def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def _refusal(self, authorization: str | None) -> grpc.aio.AioRpcError | None:
        """What the router's port would answer before its handler runs (the bearer token, then
        the Gate), or None."""
        if self._expected is not None:
            refusal = security.bearer_refusal(authorization, self._expected)
            if refusal is not None:
                return rpc_error(grpc.StatusCode.UNAUTHENTICATED, refusal)
        if self.gate.state != SERVING:
            why = "the service is loading its model" if self.gate.state == LOADING else "the service is draining"
            return rpc_error(grpc.StatusCode.UNAVAILABLE, why)
        return None

    def generate(self, req, authorization: str | None, timeout: float | None) -> LocalCall:
        """The call: iterate it for GenerateResponses; `cancel()` ends it on every tier."""
        refused = self._refusal(authorization)
        messages = _raise(refused) if refused else self.gate.servicer.generate_local(req, timeout)
        self.inflight += 1
        self._idle.clear()
        return LocalCall(messages, timeout, self)

    def _ended(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Every co-hosted request finished (the router drains them with its RPCs)."""
        return await wait_set(self._idle, timeout)

    async def serving(self, timeout: float = 2.0) -> tuple[bool, str]:
        return self.gate.state == SERVING, "serving" if self.gate.state == SERVING else "not_serving"

    async def stats(self, authorization: str | None, timeout: float = 5.0) -> dict:
        refused = self._refusal(authorization)
        if refused:
            raise refused
        return self.gate.servicer.stats()  # this process is the router's host: the full view


async def _raise(error: grpc.aio.AioRpcError):
    raise error
    yield  # pragma: no cover  (makes this an async generator)


class LocalCall:
    """One co-hosted Generate, iterated by the gateway: the router's generator runs in the task
    that awaits the next message (no queue, nothing per token), except right after the first
    message (the pipeline): the next one is pulled at once in a task of its own (`_ahead`), so
    the router opens the tiers' streams and P starts prefilling as soon as it answered, as its
    gRPC handler does, not when the HTTP response has started (a 64-request burst: tens of ms)."""

    def __init__(self, messages, timeout: float | None, owner: LocalUpstream):
        self._messages, self._owner = messages, owner
        self._waiting: asyncio.Task | None = None  # the task inside __anext__ now
        self._ahead: asyncio.Task | None = None  # the second message, pulled ahead
        self._first = True
        self._expired = self._done = False
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(timeout, self._expire) if timeout is not None else None

    def __aiter__(self) -> LocalCall:
        return self

    async def __anext__(self):
        if self._expired:
            raise _deadline()
        if self._done:
            raise rpc_error(grpc.StatusCode.CANCELLED, "the call was cancelled")
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

    def cancel(self) -> None:
        """Ends the request on every tier (a no-op once it ended)."""
        if self._done:
            return
        if self._waiting is not None:
            self._waiting.cancel()
            return
        self._finish()
        if self._ahead is not None and not self._ahead.done():
            self._ahead.cancel()  # the router's cancel path runs in that task
            self._ahead.add_done_callback(_retrieved)
            return
        if self._ahead is not None:
            self._ahead.add_done_callback(_retrieved)
        task = asyncio.ensure_future(self._messages.aclose())  # the router's cancel path, then its release
        self._owner._closing.add(task)
        task.add_done_callback(self._owner._closing.discard)

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            if self._timer is not None:
                self._timer.cancel()
            self._owner._ended()


def _retrieved(task: asyncio.Task) -> None:
    """A pulled-ahead message nobody will read: its outcome is dropped (not logged as never retrieved)."""
    if not task.cancelled():
        task.exception()


def _deadline() -> grpc.aio.AioRpcError:
    return rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
