"""Readiness, drain and per-RPC accounting for one service, in front of its servicer.

The port opens before the model loads: until `ready(servicer)`, every RPC answers UNAVAILABLE
("loading") and grpc.health.v1 says NOT_SERVING. `drain()` (SIGTERM) refuses new RPCs with
UNAVAILABLE ("draining") while in-flight ones finish; `wait_idle(timeout)` waits for them.
The gate is a servicer built from the service's protobuf descriptor, so every method (unary or
streaming either way) passes through it and is counted in the metrics. `register` installs it
with deserializers that turn malformed bytes into INVALID_ARGUMENT (grpc's own would answer
UNKNOWN with a parser traceback).
"""

from __future__ import annotations

import asyncio
import inspect
import time

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError

LOADING, SERVING, DRAINING = "loading", "serving", "draining"


class Gate:
    def __init__(self, metrics=None):
        self.state = LOADING
        self.servicer = None
        self.inflight = 0
        self.metrics = metrics
        self._idle = asyncio.Event()
        self._idle.set()

    def ready(self, servicer) -> None:
        self.servicer, self.state = servicer, SERVING

    def drain(self) -> None:
        self.state = DRAINING

    async def wait_idle(self, timeout: float) -> bool:
        return await wait_set(self._idle, timeout)

    def refusal(self) -> str | None:
        """Why a call is refused now (UNAVAILABLE: loading or draining), or None while serving."""
        if self.state == SERVING:
            return None
        return "the service is loading its model" if self.state == LOADING else "the service is draining"

    async def _enter(self, context, method: str, request=None):
        if isinstance(request, _Malformed):
            if self.metrics:
                self.metrics.rpc_total.labels(method, "INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        why = self.refusal()
        if why is not None:
            if self.metrics:
                self.metrics.rpc_total.labels(method, "UNAVAILABLE").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, why)
        self.inflight += 1
        self._idle.clear()
        if self.metrics:
            self.metrics.inflight.set(self.inflight)
        return getattr(self.servicer, method), time.perf_counter()

    def _exit(self, context, method: str, t0: float, failed: BaseException | None) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()
        if self.metrics:
            code = "OK"
            if failed is not None:
                c = _code(context)
                code = c.name if c is not None else ("CANCELLED" if isinstance(failed, asyncio.CancelledError)
                                                     else "UNKNOWN")
            self.metrics.inflight.set(self.inflight)
            self.metrics.rpc_total.labels(method, code).inc()
            self.metrics.rpc_seconds.labels(method).observe(time.perf_counter() - t0)


def _code(context):
    try:
        return context.code()
    except Exception:  # noqa: BLE001  (older grpc.aio contexts)
        return None


class _Malformed:
    """What a request that failed to parse becomes (instead of an exception in grpc's core)."""

    def __init__(self, type_name: str, error: Exception):
        self.message = f"the request is not a valid {type_name} message ({error})"


def _safe_parser(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as e:
            return _Malformed(cls.DESCRIPTOR.name, e)
    return parse


class MalformedRequest(grpc.aio.AbortError):
    """A streamed request that does not parse, raised by the request iterator. The gate aborts the
    call INVALID_ARGUMENT with `message` once the handler ends with it, in the handler's task: a
    reader task of the handler's own aborting while the handler writes a response would make two
    concurrent send operations (grpc refuses the second, and the call never ends)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


async def _checked_iter(requests, context):
    async for r in requests:
        if isinstance(r, _Malformed):
            raise MalformedRequest(r.message)
        yield r


def register(server, service_descriptor, gate: Gate) -> None:
    """Serve `service_descriptor` through the gate, with malformed requests refused cleanly."""
    proxy = gated_servicer(service_descriptor, gate)
    handlers = {}
    for m in service_descriptor.methods:
        kw = dict(request_deserializer=_safe_parser(message_factory.GetMessageClass(m.input_type)),
                  response_serializer=message_factory.GetMessageClass(m.output_type).SerializeToString)
        fn = getattr(proxy, m.name)
        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = make(fn, **kw)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_descriptor.full_name, handlers),))


def gated_servicer(service_descriptor, gate: Gate):
    """An object with one async method per RPC of `service_descriptor`, forwarding to
    `gate.servicer` once it is ready (register it with the generated add_*_to_server)."""
    methods = {}
    for m in service_descriptor.methods:
        if m.server_streaming:
            async def stream(self, request, context, _name=m.name, _client_stream=m.client_streaming):
                fn, t0 = await gate._enter(context, _name, None if _client_stream else request)
                if _client_stream:
                    request = _checked_iter(request, context)
                failed, result = None, None
                try:
                    result = fn(request, context)
                    if inspect.isasyncgen(result):
                        async for item in result:
                            yield item
                    else:
                        await result
                except MalformedRequest as e:
                    failed = e
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.message)
                except BaseException as e:
                    failed = e
                    raise
                finally:
                    if inspect.isasyncgen(result):  # closed from outside (a client cancel while yielding):
                        await result.aclose()  # run the handler's cleanup now, never at some later GC
                    gate._exit(context, _name, t0, failed)
                    failed = None  # no frame <-> traceback cycle keeps this frame (and `result`) alive
            methods[m.name] = stream
        else:
            async def unary(self, request, context, _name=m.name, _client_stream=m.client_streaming):
                fn, t0 = await gate._enter(context, _name, None if _client_stream else request)
                if _client_stream:
                    request = _checked_iter(request, context)
                failed = None
                try:
                    return await fn(request, context)
                except MalformedRequest as e:
                    failed = e
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.message)
                except BaseException as e:
                    failed = e
                    raise
                finally:
                    gate._exit(context, _name, t0, failed)
                    failed = None
            methods[m.name] = unary
    return type(f"Gated{service_descriptor.name}", (), methods)()


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """Whether `event` was set within `timeout` seconds (draining: nothing in flight any more)."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
        return True
    except TimeoutError:
        return False
