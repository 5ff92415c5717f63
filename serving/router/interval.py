"""Stream intervals: the user's messages grouped, K tokens each, no token waiting past a bound.

`[router] stream_interval` (tokens per message) and `stream_interval_ms` (the longest a ready
token may wait before it is sent; 0: no time bound) are the service's; a request's
`GenerateRequest.stream_interval` / `stream_interval_ms` may only be coarser (as vLLM's): a finer
one is raised to the service's (`chosen`), one out of range is INVALID_ARGUMENT naming the field.

`Group` sits between `stream.Output`'s per-batch deltas and the user's stream. The first delta
with tokens and the final one (finish_reason) go at once; the others are held and joined (`join`:
tokens, sources, text, logprobs appended; a tool call's deltas merged into one per call) until K
tokens are held, or the oldest held token waited the bound (`Output` wakes for it: `due`). A
`Delta` is plain Python: only what goes out becomes a GenerateResponse (`Output._response`), once
per message, so a held token costs list appends, not protobuf construction. Every message still
carries deltas only: what was held goes once, in order.
"""

from __future__ import annotations

import time

import grpc

from serving.config import MAX_STREAM_INTERVAL, MAX_STREAM_INTERVAL_MS
from serving.router.request import Abort


def chosen(tokens: int, ms: float, req) -> tuple[int, float]:
    """The (tokens, ms) a request streams at: the service's, or the request's where coarser
    (more tokens; a longer bound, 0 = none the coarsest); out of range -> Abort INVALID_ARGUMENT."""
    if req.HasField("stream_interval"):
        if not 1 <= req.stream_interval <= MAX_STREAM_INTERVAL:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"stream_interval must be in 1..{MAX_STREAM_INTERVAL} "
                                                          f"tokens, got {req.stream_interval}")
        tokens = max(tokens, req.stream_interval)
    if req.HasField("stream_interval_ms"):
        if req.stream_interval_ms > MAX_STREAM_INTERVAL_MS:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"stream_interval_ms must be in 0..{MAX_STREAM_INTERVAL_MS} "
                                                          f"(0: no time bound), got {req.stream_interval_ms}")
        ms = 0.0 if ms == 0 or req.stream_interval_ms == 0 else max(ms, float(req.stream_interval_ms))
    return tokens, ms


class Delta:
    """What a message adds to the user's stream: tokens, their sources, text pieces, logprobs
    (TokenLogprob), tool-call deltas (ToolCallDelta), and the finish reason (0: none)."""

    __slots__ = ("token_ids", "sources", "text", "logprobs", "tool_calls", "finish_reason")

    def __init__(self, token_ids: list[int], sources: list[int], text: str = "", logprobs=(), tool_calls=(),
                 finish_reason: int = 0):
        self.token_ids, self.sources, self.finish_reason = token_ids, sources, finish_reason
        self.text = [text] if text else []  # pieces, joined once when the message is built
        self.logprobs, self.tool_calls = list(logprobs), list(tool_calls)


def join(held: Delta, d: Delta) -> None:
    """`d` appended to `held` (deltas of one request, in order)."""
    held.token_ids += d.token_ids
    held.sources += d.sources
    held.text += d.text
    held.logprobs += d.logprobs
    for c in d.tool_calls:
        last = held.tool_calls[-1] if held.tool_calls else None
        if last is not None and last.index == c.index:  # the same call: its pieces in one delta
            last.arguments += c.arguments
            last.id, last.name = last.id or c.id, last.name or c.name
        else:
            held.tool_calls.append(c)
    held.finish_reason = held.finish_reason or d.finish_reason


def joins(d: Delta, nxt) -> bool:
    """`nxt` may join `d` in one message: a Delta from the same tier (a switch starts a message)."""
    return isinstance(nxt, Delta) and (not d.sources or not nxt.sources or d.sources[-1] == nxt.sources[0])


class Group:
    """One request's held delta (or none). `add(d)` -> the Delta to send now, or None."""

    def __init__(self, tokens: int = 1, ms: float = 0.0):
        self.tokens, self.wait_s = tokens, ms / 1e3
        self.held: Delta | None = None  # the delta the others are joined into
        self.count = 0  # tokens held
        self.due: float | None = None  # perf_counter by which `held` must go (a bound set, something held)
        self.started = False  # the first tokens went

    def add(self, d: Delta) -> Delta | None:
        if self.held is None:
            if not self.started or d.finish_reason or self.tokens == 1:
                self.started = self.started or bool(d.token_ids)
                return d
            self.held, self.count = d, len(d.token_ids)
            self.due = time.perf_counter() + self.wait_s if self.wait_s else None
        else:
            join(self.held, d)
            self.count += len(d.token_ids)
        return self.take() if self.count >= self.tokens or d.finish_reason else None

    def take(self) -> Delta:
        """The held delta (its bound passed, or it is complete); nothing is held after."""
        d, self.held, self.count, self.due = self.held, None, 0, None
        return d
