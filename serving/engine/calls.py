"""Calls: unary calls as messages of one stream (RLD and MD). The router keeps one open per
instance for its Reserve, MatchPrefix and Release, and RLD one per MD for HandoffTokens
(serving/call_link.py), so a call costs a message each way instead of an RPC's setup and
teardown (~0.3-0.5 ms of CPU per unary call on this machine, against tens of us a message).

Each `CallRequest` runs the servicer's own method for it, with a `CallContext` that answers what
the method reads of its context (the deadline from `timeout_s`, the stream's peer identity) and
turns `abort` into the call's result: the same checks, the same answers, code and sentence as the
unary RPC. The stream's first result is `id` 0, code 0: it is served (a caller sends its calls
after it). Calls run concurrently and are answered by id as they finish; `cancel` cancels one
(its answer is dropped). With TLS on, each call is checked against the authorisation table under
its own method's name (serving/authz.py), as its unary RPC would be. While the service drains,
a new call is answered UNAVAILABLE and the stream ends once none is in flight. The caller
half-closing ends the stream once its calls are answered; the caller going away cancels them.
Each call counts in the service's pddjax_rpc_total / pddjax_rpc_seconds under its own method.
At most MAX_IN_FLIGHT calls run at once on one stream; one more is refused RESOURCE_EXHAUSTED
(a cancelled call's place is free at once, for a call sent right after the cancel).
"""

from __future__ import annotations

import asyncio
import math
import time

import grpc

from serving import authz
from serving.call_link import METHODS
from serving.pb import cluster_pb2

SERVICE = "/pddjax.v1.Decode/"
MAX_IN_FLIGHT = 1024  # calls running at once on one stream; more are refused RESOURCE_EXHAUSTED (as
# unary RPCs past the server's max_concurrent_rpcs would be)


class CallAborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class CallContext:
    """What a unary method reads of its context, for one call on a Calls stream."""

    def __init__(self, stream_context, timeout_s: float):
        self.stream = stream_context
        self.deadline = time.monotonic() + timeout_s if timeout_s > 0 else None

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        raise CallAborted(code, details)

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def auth_context(self):
        return self.stream.auth_context()

    def peer(self) -> str:
        return self.stream.peer()

    def invocation_metadata(self):
        return self.stream.invocation_metadata()


class CallStream:
    """One Calls stream's calls in flight (event-loop thread only); `drain()` per _persistent."""

    def __init__(self, servicer, role: str, context, metrics=None):
        self.servicer, self.role, self.context, self.metrics = servicer, role, context, metrics
        self.tasks: dict[int, asyncio.Task] = {}
        self.out: asyncio.Queue = asyncio.Queue()
        self.draining = False
        # identities exist only with TLS (RoleAuthz then checked the stream itself): each call too
        self.checked = bool((context.auth_context() or {}).get("peer_spiffe_id"))

    def drain(self) -> None:
        self.draining = True
        self.out.put_nowait(None)  # wake the writer: it ends once no call is in flight

    def start(self, msg: cluster_pb2.CallRequest) -> None:
        kind = msg.WhichOneof("call")
        if kind == "cancel":  # its slot frees at once: a call sent right after the cancel finds it free
            task = self.tasks.pop(msg.id, None)
            if task is not None:
                task.cancel()
                if self.draining and not self.tasks:
                    self.out.put_nowait(None)
            return
        if kind is None or msg.id == 0:
            return self._answer(msg.id, grpc.StatusCode.INVALID_ARGUMENT, f"call {msg.id} names no method"
                                if kind is None else "call ids start at 1 (0 is the stream's own)")
        if msg.id in self.tasks:
            return self._answer(msg.id, grpc.StatusCode.INVALID_ARGUMENT, f"call {msg.id} is already in flight")
        method = METHODS[kind]
        if len(self.tasks) >= MAX_IN_FLIGHT:
            return self._answer(msg.id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{MAX_IN_FLIGHT} calls are already running on this Calls stream")
        if self.draining:
            return self._answer(msg.id, grpc.StatusCode.UNAVAILABLE, f"{self.role} is draining")
        if self.checked:
            why = authz.refusal(self.role, SERVICE + method, authz.peer_role(self.context))
            if why:
                return self._answer(msg.id, grpc.StatusCode.PERMISSION_DENIED, why)
        if msg.timeout_s < 0 or not math.isfinite(msg.timeout_s):  # negative, infinite or NaN
            return self._answer(msg.id, grpc.StatusCode.INVALID_ARGUMENT, f"call {msg.id} has a bad timeout")
        task = asyncio.ensure_future(self._run(msg.id, kind, method, getattr(msg, kind), msg.timeout_s))
        self.tasks[msg.id] = task

    async def _run(self, call_id: int, kind: str, method: str, request, timeout_s: float) -> None:
        ctx, t0, code = CallContext(self.context, timeout_s), time.perf_counter(), grpc.StatusCode.CANCELLED
        try:
            fn = getattr(self.servicer, method)(request, ctx)
            answer = await (asyncio.wait_for(fn, timeout_s) if timeout_s > 0 else fn)
        except asyncio.CancelledError:
            return  # the caller cancelled the call, or left: no answer
        except CallAborted as e:
            code = e.code
            self._answer(call_id, e.code, e.details)
        except TimeoutError:
            code = grpc.StatusCode.DEADLINE_EXCEEDED
            self._answer(call_id, code, f"{method} ran past its {timeout_s:.3g} s deadline")
        except Exception as e:  # a bug in the method: the call fails, the stream and the others go on
            code = grpc.StatusCode.UNKNOWN
            self._answer(call_id, code, f"{method} failed on {self.role}: {e!r}")
        else:
            code = grpc.StatusCode.OK
            self.out.put_nowait(cluster_pb2.CallResult(id=call_id, **{kind: answer}))
        finally:
            if self.tasks.get(call_id) is asyncio.current_task():
                del self.tasks[call_id]
            if self.draining and not self.tasks:
                self.out.put_nowait(None)
            if self.metrics is not None:  # counted by its own method, as its RPC would be
                self.metrics.rpc_total.labels(method, code.name).inc()
                self.metrics.rpc_seconds.labels(method).observe(time.perf_counter() - t0)

    def _answer(self, call_id: int, code: grpc.StatusCode, error: str) -> None:
        self.out.put_nowait(cluster_pb2.CallResult(id=call_id, code=code.value[0], error=error))

    async def serve(self, request_iterator):
        """The stream's results, as its calls finish (an async generator); first `CallResult(id=0)`:
        the stream is served here (the caller sends its calls once it has it)."""
        reading = asyncio.ensure_future(self._read(request_iterator))
        try:
            yield cluster_pb2.CallResult(id=0)
            while True:
                if reading.done() and (reading.cancelled() or reading.exception() is not None):
                    reading.result()  # a malformed message (gate.MalformedRequest): the gate aborts the stream
                if reading.done() and not self.tasks and self.out.empty():
                    reading.result()  # a read error ends the stream with it
                    return
                if self.draining and not self.tasks and self.out.empty():
                    return
                getting = asyncio.ensure_future(self.out.get())
                await asyncio.wait({getting} if reading.done() else {getting, reading},
                                   return_when=asyncio.FIRST_COMPLETED)
                if not getting.done():
                    getting.cancel()
                    continue
                item = getting.result()
                if item is not None:
                    yield item
        finally:
            reading.cancel()
            for task in list(self.tasks.values()):
                task.cancel()

    async def _read(self, request_iterator) -> None:
        async for msg in request_iterator:
            self.start(msg)
