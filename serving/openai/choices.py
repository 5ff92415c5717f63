"""n > 1: n choices of one prompt, each its own router request.

Choice i samples with seed + i (mod 2^31; a request without a seed draws one), carries the
same session id (the request's, else the response id: the router sends the n to the same P and
MD) and is handed off on its own under pdd. Choice 0 is sent first; the others once its first
message arrived, when P's prefix cache holds the prompt: they are served from the pages it
left there (full 16-token pages shared, the tail recomputed), not prefilled n times. A choice
that fails fails the whole response (the others are cancelled). Usage: the prompt once, the
completion tokens of every choice summed. Streamed: chunks of every choice interleaved as
they come, each with its `index`, a finishing chunk per choice, then the usage chunk.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from serving.openai import translate
from serving.openai.answer import Answer
from serving.openai.errors import OpenAIError, from_rpc
from serving.pb import router_pb2


def requests(body, rid: str, session: str | None, default_max_tokens: int) -> list[router_pb2.GenerateRequest]:
    """The n router requests of one body (`body.n` checked by translate)."""
    first = translate.generate_request(body, rid, session, default_max_tokens)
    if not first.session_id:
        first.session_id = rid
    out = []
    for i in range(body.n or 1):
        req = router_pb2.GenerateRequest()
        req.CopyFrom(first)
        req.request_id = f"{rid}-{i}"
        req.sampling.seed = (first.sampling.seed + i) % translate.SEEDS
        out.append(req)
    return out


class Fanout:
    """The n calls of one response: `start()` sends choice 0, waits for its first message, then
    the rest; `messages()` yields (choice index, GenerateResponse) as they arrive."""

    def __init__(self, upstream, reqs, authorization, deadline: float):
        self.upstream, self.reqs, self.auth, self.deadline = upstream, reqs, authorization, deadline
        self.calls: list = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.head = None

    async def start(self) -> None:
        self._open(0)
        first = await self.queue.get()
        if isinstance(first[1], BaseException):
            raise first[1]
        self.head = first  # messages() yields it before what choice 0's pump queued behind it
        for i in range(1, len(self.reqs)):
            self._open(i)

    def _open(self, i: int) -> None:
        call = self.upstream.generate(self.reqs[i], self.auth, self.deadline)
        self.calls.append(call)
        self.tasks.append(asyncio.create_task(self._pump(i, call)))

    async def _pump(self, i: int, call) -> None:
        try:
            async for msg in call:
                self.queue.put_nowait((i, msg))
            self.queue.put_nowait((i, None))
        except (grpc.aio.AioRpcError, OpenAIError) as e:
            self.queue.put_nowait((i, e))

    async def messages(self):
        open_ = len(self.reqs)
        head, self.head = self.head, None
        while open_:
            i, msg = head if head is not None else await self.queue.get()
            head = None
            if isinstance(msg, BaseException):
                raise msg
            if msg is None:
                open_ -= 1
                continue
            yield i, msg

    def cancel(self) -> None:
        for c in self.calls:
            c.cancel()
        for t in self.tasks:
            t.cancel()


def usage(answers: list[Answer]):
    """The prompt's tokens once, every choice's completion tokens."""
    u = answers[0].usage()
    completion = sum(a.usage().completion_tokens for a in answers)
    return u.model_copy(update={"completion_tokens": completion, "total_tokens": u.prompt_tokens + completion})


def response(answers: list[Answer]):
    whole = answers[0].response()
    return whole.model_copy(update={"choices": [a.response().choices[0] for a in answers], "usage": usage(answers)})


async def stream_events(fan: Fanout, answers: list[Answer], include_usage: bool, event, done: bytes, outcome: dict):
    """SSE events of n interleaved choices (chat: each choice's role chunk first)."""
    dump = dict(exclude_unset=True)
    t0 = time.perf_counter()
    for a in answers:
        if a.chat:
            yield event(a.chunk("", role=True, usage_null=include_usage).model_dump_json(**dump))
    try:
        async for i, msg in fan.messages():
            a = answers[i]
            a.take(msg)
            if a.gateway_ttft_ms is None and msg.token_ids:
                a.gateway_ttft_ms = round(1e3 * (time.perf_counter() - t0), 2)
            if msg.token_ids or msg.text or msg.tool_calls:
                yield event(a.message_chunk_json(msg, include_usage))
            if msg.finish_reason:
                yield event(a.chunk(None, finish=a.finish or "stop", usage_null=include_usage).model_dump_json(**dump))
    except grpc.aio.AioRpcError as e:
        err = from_rpc(e)
        outcome["code"] = err.status
        yield event(err.body().model_dump_json())
        yield done
        return
    if include_usage:
        chunk = answers[0].usage_chunk()
        yield event(chunk.model_copy(update={"usage": usage(answers)}).model_dump_json(**dump))
    outcome["code"] = 200
    yield done
