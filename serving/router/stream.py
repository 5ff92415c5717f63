"""The user's token stream: the tiers' Decode streams in, GenerateResponses out.

  - `pump` forwards one tier's Decode stream into a queue (`Request.relay_out` / `main_out`);
    a broken stream becomes an `Abort` there, or what its `on_error` makes of it (pdd's RLD:
    MD taking over, `recovery.take_over`);
  - `expire` puts the client's deadline into the queues (the stream fails DEADLINE_EXCEEDED
    even when no tier reports it);
  - `Output.messages` reads the relay queue, then (after a batch `handed_off`) the main one,
    checks every batch's position (no gap, duplicate or reorder), decodes text (holding back an
    incomplete UTF-8 sequence; stop strings end the stream), times tokens (TTFT, ITL, RLD's
    decode speed), and puts usage and timings on the last message. The caller settles the
    request when it gets that message, before passing it on.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc

from serving.pb import common_pb2, router_pb2
from serving.router.request import PIPELINE_NAMES, Abort, Request, from_rpc

if TYPE_CHECKING:
    from serving.router.metrics import RouterMetrics


def expire(*queues: asyncio.Queue) -> None:
    """The client's deadline passed: the stream fails with DEADLINE_EXCEEDED (then releases all)."""
    for q in queues:
        q.put_nowait(Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed before it finished"))


def _terminal(item) -> bool:
    return isinstance(item, Abort) or bool(item.finish_reason) or item.handed_off


async def pump(call, q: asyncio.Queue, who: str, on_error=None) -> None:
    """A tier's token stream into `q`; a failure becomes an Abort, or what `on_error(err, tokens
    forwarded so far)` makes of it (pdd's RLD: MD taking over)."""
    seen: list[int] = []
    try:
        async for batch in call:
            q.put_nowait(batch)
            seen += batch.token_ids
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            err = from_rpc(e, who)
            q.put_nowait(await on_error(err, seen) if on_error else err)


class Output:
    """One request's outgoing stream. `tokenizer` None: no text; `stop_strings` end it early."""

    def __init__(self, r: Request, tokenizer, stop_strings, metrics: RouterMetrics):
        self.r, self.tok, self.stop_strings = r, tokenizer, list(stop_strings)
        self.timer, self.text = metrics.timer(r.t0), ""

    async def messages(self):
        """-> GenerateResponses until (and with) the one that has a finish_reason."""
        r = self.r
        current, source = (r.relay_out, common_pb2.ROLE_RELAY) if r.uses_relay else (r.main_out, common_pb2.ROLE_MAIN)
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        while not finish:
            items = [await current.get()]
            while not current.empty() and not _terminal(items[-1]):
                items.append(current.get_nowait())
            new, switch = [], False
            for it in items:
                if isinstance(it, Abort):
                    raise it
                if it.token_ids and it.start_position != len(r.tokens) + len(new):
                    raise Abort(grpc.StatusCode.INTERNAL, f"token stream out of order at position {it.start_position}")
                new += it.token_ids
                switch = switch or it.handed_off
                finish = finish or it.finish_reason
            if new or finish:
                delta, stop = self._add(new, source)
                finish = common_pb2.FINISH_REASON_STOP if stop else finish
                msg = router_pb2.GenerateResponse(request_id=r.label, token_ids=new, sources=[source] * len(new),
                                                  text=delta)
                if finish:
                    msg.finish_reason = finish
                    self._summary(msg)
                yield msg
            if switch:
                current, source, r.handoff_at = r.main_out, common_pb2.ROLE_MAIN, len(r.tokens)

    def _add(self, new: list[int], source: int) -> tuple[str, bool]:
        """Books `new` tokens (times, text) -> (their text, a stop string ended the text)."""
        r, now = self.r, time.perf_counter()
        if r.ttft is None and new:
            r.ttft = now - r.t0
        if source == common_pb2.ROLE_RELAY and new:  # RLD's decode speed, after its first batch
            r.relay_t0 = r.relay_t0 or now
            r.relay_after += len(new) if now > r.relay_t0 else 0
            r.relay_t1 = now
        r.tokens += new
        r.sources += [source] * len(new)
        self.timer.tokens(PIPELINE_NAMES[r.pipeline], len(new), now)
        delta, self.text, stop = self._decode()
        return delta, stop

    def _decode(self) -> tuple[str, str, bool]:
        """-> (new text, all text so far, a stop string was hit)."""
        if self.tok is None:
            return "", "", False
        full = self.tok.decode(self.r.tokens, skip_special=True)
        if full.endswith("\ufffd"):  # hold back an incomplete UTF-8 sequence
            return "", self.text, False
        for s in self.stop_strings:
            i = full.find(s, max(0, len(self.text) - len(s)))
            if s and i >= 0:
                return full[len(self.text):i], full[:i], True
        return full[len(self.text):], full, False

    def _summary(self, msg: router_pb2.GenerateResponse) -> None:
        r = self.r
        msg.usage.CopyFrom(router_pb2.Usage(
            prompt_tokens=len(r.prompt), cached_on_prefill=r.cached_prefill, cached_on_main=r.cached_main,
            completion_tokens=len(r.tokens), relay_tokens=r.sources.count(common_pb2.ROLE_RELAY),
            main_tokens=r.sources.count(common_pb2.ROLE_MAIN), kv_bytes_to_relay=r.bytes_relay,
            kv_bytes_to_main=r.bytes_main, handoff_tokens=r.handoff_tokens, handoff_chunks=r.handoff_chunks))
        msg.timings.CopyFrom(router_pb2.Timings(
            ttft_ms=1e3 * (r.ttft or 0), total_ms=1e3 * (time.perf_counter() - r.t0), prefill_ms=r.prefill_ms,
            kv_to_main_ms=r.main_kv_ms, handoff_position=r.handoff_at or 0))
