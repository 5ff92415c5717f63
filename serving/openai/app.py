"""The gateway's HTTP API (FastAPI): OpenAI's endpoints over the router's streaming Generate.

  POST /v1/chat/completions, POST /v1/completions   streamed (server-sent events: starlette's
       StreamingResponse, each event framed by sse-starlette's ServerSentEvent; one chunk per
       router message, then include_usage's usage chunk, then `data: [DONE]`) or not
  GET  /v1/models    the served model (the router answers Stats with the client's token first;
                     no address of the router's)
  GET  /health       200 when the router serves (its grpc.health.v1; co-hosted: its Gate), else 503
Its Prometheus metrics are not on this (public) port: they join the router's metrics endpoint
(co-hosted) or a metrics port of their own (server.py). Every error, the framework's included,
is OpenAI's error JSON (errors.py); bodies and connections are bounded (edge.py). A request's
deadline (`request_timeout`, else the gateway's default) is capped at MAX_REQUEST_TIMEOUT_S.

The router is an upstream_api.Upstream: over gRPC (upstream.GrpcUpstream) or, in the router's
process, serving/stack/cohost.RouterUpstream. A request: body checked (pydantic, then
`translate`: 400), the Generate call opened with the client's Authorization, and its first
message awaited: a router refusal comes before it, so it becomes the HTTP status
(errors.py); then the answer streams or is collected. The call is cancelled (every tier
releases the request) whenever the client goes away: mid-stream (the StreamingResponse's
disconnect watch cancels the body task), while the gateway waits for the first message or
collects a non-streamed answer (`_unless_gone`), or if the response never started.
`Gateway.wait_idle` waits for the requests in flight (a drain: the router refuses new ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse  # starlette's, re-exported
from sse_starlette import ServerSentEvent

from serving.gate import wait_set
from serving.openai import choices, errors, translate
from serving.openai.answer import Answer, Served
from serving.openai.edge import BodyLimit
from serving.openai.errors import OpenAIError, from_rpc
from serving.openai.metrics import CLIENT_GONE, GatewayMetrics
from serving.openai.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from serving.openai.upstream_api import Upstream

PING_S = 15.0  # as sse-starlette's default
PING = ServerSentEvent(comment="ping").encode()
DONE = ServerSentEvent("[DONE]").encode()
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream
_PINGS: set[asyncio.Task] = set()  # keep-alive sends in flight (referenced until done)
MAX_REQUEST_TIMEOUT_S = 1800.0  # a request's deadline at most (the router's [router] max_deadline_s default)


def _event(data: str) -> bytes:
    return ServerSentEvent(data).encode()


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, coro):
    """`coro`'s result, unless the client disconnects first (then `coro` is cancelled: ClientGone)."""
    work, gone = asyncio.ensure_future(coro), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled():
        raise ClientGone
    return work.result()


async def _collect(messages, answer: Answer) -> None:
    async for msg in messages:
        answer.take(msg)


async def _collect_n(fan, answers: list[Answer]) -> None:
    async for i, msg in fan.messages():
        answers[i].take(msg)


class _Stream(StreamingResponse):
    """A server-sent-event stream (starlette's StreamingResponse: the body task and its
    disconnect watch) that runs `on_close` however it ends (also if it never started) and sends
    a keep-alive comment every PING_S (a proxy keeps a quiet stream open: a long prefill or a
    slow WAN's KV before the first token), from one timer per request: nothing per token."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close, self._send, self._ping = on_close, None, None

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._send = None
            if self._ping is not None:
                self._ping.cancel()
            self._on_close()

    async def stream_response(self, send) -> None:
        self._send = send
        self._ping = asyncio.get_running_loop().call_later(PING_S, self._keep_alive)
        try:
            await super().stream_response(send)
        finally:
            self._send = None  # the last body message has gone (or the stream failed): no ping after it

    def _keep_alive(self) -> None:
        if self._send is not None:
            task = asyncio.ensure_future(self._ping_once())
            _PINGS.add(task)
            task.add_done_callback(_PINGS.discard)
            self._ping = asyncio.get_running_loop().call_later(PING_S, self._keep_alive)

    async def _ping_once(self) -> None:
        send = self._send  # checked when this task runs: its one write is atomic, between two events
        if send is not None:
            with contextlib.suppress(Exception):  # the client went away: the body task ends the stream
                await send({"type": "http.response.body", "body": PING, "more_body": True})


class Gateway:
    def __init__(self, upstream: Upstream, served: Served, *, check_model: bool = True, default_max_tokens: int = 256,
                 request_timeout: float | None = 600.0, metrics: GatewayMetrics | None = None,
                 cache_hits: bool = False):
        """`cache_hits`: responses tell the prefix caches' hits (usage's cached_tokens, the
        extension's; PDDJAX_OPENAI_CACHE_HITS): off, no caller learns what another one's prompts left cached."""
        self.upstream, self.served, self.check_model = upstream, served, check_model
        self.default_max_tokens, self.request_timeout = default_max_tokens, request_timeout
        self.cache_hits = cache_hits
        self.metrics = metrics or GatewayMetrics()
        self.started = int(time.time())
        self.inflight = 0  # requests from their body's arrival until their response ended
        self._idle = asyncio.Event()
        self._idle.set()

    def _enter(self) -> None:
        self.inflight += 1
        self._idle.clear()
        self.metrics.inflight.inc()

    def _leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()
        self.metrics.inflight.dec()

    async def wait_idle(self, timeout: float) -> bool:
        """Whether every request in flight ended within `timeout` seconds."""
        return await wait_set(self._idle, timeout)

    async def complete(self, body: ChatCompletionRequest | CompletionRequest, request: Request, chat: bool):
        endpoint, t0 = ("chat" if chat else "completions"), time.perf_counter()
        call, streaming = None, False
        self._enter()
        try:
            if self.check_model and body.model != self.served.name:
                raise OpenAIError(404, f"model {body.model!r} is not served here (this gateway serves "
                                       f"{self.served.name!r})", "invalid_request_error", "model", "model_not_found")
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            if (body.n or 1) > 1:
                response, streaming = await self._complete_n(body, request, chat, rid, endpoint)
                return response
            req = translate.generate_request(body, rid, request.headers.get("x-session-id"), self.default_max_tokens)
            answer = Answer(chat, rid, self.served, body.return_token_ids, self.cache_hits, req.sampling.logprobs)
            call = self.upstream.generate(req, request.headers.get("authorization"), self.deadline(body))
            messages = aiter(call)
            try:
                answer.take(await _unless_gone(request, anext(messages)))
            except StopAsyncIteration:
                raise OpenAIError(502, "the router ended the stream without an answer", "server_error") from None
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                outcome = {"code": CLIENT_GONE}  # what the stream ended with (set by _events)

                def closed(call=call):
                    call.cancel()  # a no-op once the router finished
                    self._leave()
                    self.metrics.answered(endpoint, outcome["code"])

                stream = _Stream(self._events(messages, answer, include_usage, endpoint, t0, outcome), closed)
                call, streaming = None, True  # the stream owns both now
                return stream
            await _unless_gone(request, _collect(messages, answer))
            self.metrics.timer(endpoint, t0).tokens(len(answer.token_ids))
            answer.gateway_ttft_ms = round(1e3 * (time.perf_counter() - t0), 2)
            self.metrics.answered(endpoint, 200)
            return Response(answer.response().model_dump_json(exclude_unset=True), media_type="application/json")
        except OpenAIError as e:
            self.metrics.answered(endpoint, e.status)
            raise
        except grpc.aio.AioRpcError as e:
            err = from_rpc(e)
            self.metrics.answered(endpoint, err.status)
            raise err from None
        except ClientGone:
            self.metrics.answered(endpoint, CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        finally:
            if call is not None:
                call.cancel()
            if not streaming:
                self._leave()

    async def _complete_n(self, body, request: Request, chat: bool, rid: str, endpoint: str):
        """n > 1 (serving/openai/choices.py) -> (the response, whether it streams: then the stream
        ends the request's accounting when it closes)."""
        reqs = choices.requests(body, rid, request.headers.get("x-session-id"), self.default_max_tokens)
        answers = []
        for i in range(len(reqs)):
            answers.append(Answer(chat, rid, self.served, body.return_token_ids, self.cache_hits,
                                  reqs[0].sampling.logprobs))
            answers[-1].index = i
        fan = choices.Fanout(self.upstream, reqs, request.headers.get("authorization"), self.deadline(body))
        try:
            await _unless_gone(request, fan.start())
        except BaseException:
            fan.cancel()
            raise
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            outcome = {"code": CLIENT_GONE}

            def closed():
                fan.cancel()
                self._leave()
                self.metrics.answered(endpoint, outcome["code"])

            events = choices.stream_events(fan, answers, include_usage, _event, DONE, outcome)
            return _Stream(events, closed), True
        try:
            await _unless_gone(request, _collect_n(fan, answers))
        finally:
            fan.cancel()
        self.metrics.answered(endpoint, 200)
        return Response(choices.response(answers).model_dump_json(exclude_unset=True),
                        media_type="application/json"), False

    def deadline(self, body: ChatCompletionRequest | CompletionRequest) -> float:
        """The request's deadline in seconds: the client's, else the default, at most MAX_REQUEST_TIMEOUT_S."""
        return min(body.request_timeout or self.request_timeout or MAX_REQUEST_TIMEOUT_S, MAX_REQUEST_TIMEOUT_S)

    async def _events(self, messages, answer: Answer, include_usage: bool, endpoint: str, t0: float, outcome: dict):
        """SSE events (sse-starlette's ServerSentEvent framing): the role chunk (chat), one chunk
        per router message with tokens, the finishing chunk (finish_reason, the pddjax extension),
        the usage chunk, [DONE]; `outcome["code"]`: the HTTP status it ended with (a router error: its status)."""
        timer, dump = self.metrics.timer(endpoint, t0), dict(exclude_unset=True)
        if answer.chat:
            yield _event(answer.chunk("", role=True, usage_null=include_usage).model_dump_json(**dump))
        try:
            async for msg in messages:
                answer.take(msg)
                if msg.token_ids or msg.text or msg.tool_calls:
                    timer.tokens(len(msg.token_ids))
                    if answer.gateway_ttft_ms is None:
                        answer.gateway_ttft_ms = round(1e3 * (time.perf_counter() - t0), 2)
                    yield _event(answer.message_chunk_json(msg, include_usage))
        except grpc.aio.AioRpcError as e:
            err = from_rpc(e)
            outcome["code"] = err.status
            yield _event(err.body().model_dump_json())
            yield DONE
            return
        last = answer.chunk(None, finish=answer.finish or "stop", usage_null=include_usage)
        yield _event(last.model_dump_json(**dump))
        if include_usage:
            yield _event(answer.usage_chunk().model_dump_json(**dump))
        outcome["code"] = 200
        yield DONE

    async def models(self, request: Request) -> ModelList:
        try:
            st = await self.upstream.stats(request.headers.get("authorization"))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.PERMISSION_DENIED:  # the key is checked all the same
                raise from_rpc(e) from None
            st = {}  # a gateway on another host: the router keeps its operator's view (Stats) to itself
        healthy: dict[str, int] = {}
        for inst in st.get("instances", []):
            healthy[inst["role"]] = healthy.get(inst["role"], 0) + bool(inst.get("healthy"))
        card = ModelCard(id=self.served.name, object="model", created=self.started, owned_by="pddjax",
                         pddjax={"fingerprint": self.served.fingerprint, "healthy_instances": healthy,
                                 **({"model": st["model"]} if "model" in st else {})})
        return ModelList(object="list", data=[card])

    async def health(self):
        ok, status = await self.upstream.serving()
        if ok:
            return {"status": "ok", "router": status}
        return OpenAIError(503, f"the router is not serving ({status})", "service_unavailable",
                           code="router_not_serving").response()


def create_app(gw: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        gw.upstream.open()
        try:
            yield
        finally:
            await gw.upstream.close()

    app = FastAPI(title="pddjax OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    errors.install(app)
    app.add_middleware(BodyLimit)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await gw.complete(body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await gw.complete(body, request, chat=False)

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        return await gw.models(request)

    @app.get("/health")
    async def health():
        return await gw.health()

    return app
