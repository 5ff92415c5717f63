"""The user's messages: a stream's `interval.Delta` -> the GenerateResponse that carries it.

Built once per message sent (not per batch): the tokens, their sources, the text, tool-call
deltas and logprobs (each logprob's token and top tokens as text, and as exact bytes once
`token_bytes` has the tokenizer's table); the last message also carries the request's usage
and timings.
"""

from __future__ import annotations

import time

from serving.pb import common_pb2, router_pb2
from serving.router import token_bytes
from serving.router.interval import Delta
from serving.router.request import Request


class Messages:
    """`Messages(r, tokenizer)(d)` -> r's GenerateResponse for `d` (tokenizer None: no token strings)."""

    def __init__(self, r: Request, tokenizer):
        self.r, self.tokenizer = r, tokenizer
        self._texts: dict[int, str] = {}  # token id -> its text alone (logprobs' token strings)

    def __call__(self, d: Delta) -> router_pb2.GenerateResponse:
        msg = router_pb2.GenerateResponse(request_id=self.r.label, token_ids=d.token_ids, sources=d.sources,
                                          text="".join(d.text), logprobs=d.logprobs, tool_calls=d.tool_calls)
        if d.logprobs and self.tokenizer is not None:
            exact = token_bytes.get(self.tokenizer)  # None until built (token_bytes.build, at the router's start)
            for tok, lp in zip(d.token_ids, msg.logprobs):
                lp.token = self._text(tok)
                lp.top_tokens.extend(self._text(t) for t in lp.top_ids)
                if exact is not None:
                    lp.token_bytes = exact([tok])
                    lp.top_token_bytes.extend(exact([t]) for t in lp.top_ids)
        if d.finish_reason:
            msg.finish_reason = d.finish_reason
            self._summary(msg)
        return msg

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _summary(self, msg: router_pb2.GenerateResponse) -> None:
        r = self.r
        msg.usage.CopyFrom(router_pb2.Usage(
            prompt_tokens=len(r.prompt), cached_on_prefill=r.cached_prefill, cached_on_main=r.cached_main,
            completion_tokens=len(r.tokens), relay_tokens=r.sources.count(common_pb2.ROLE_RELAY),
            main_tokens=r.sources.count(common_pb2.ROLE_MAIN), kv_bytes_to_relay=r.bytes_relay,
            kv_bytes_to_main=r.bytes_main, handoff_tokens=r.handoff_tokens, handoff_chunks=r.handoff_chunks))
        msg.timings.CopyFrom(router_pb2.Timings(
            ttft_ms=1e3 * (r.ttft or 0), total_ms=1e3 * (time.perf_counter() - r.t0), prefill_ms=r.prefill_ms,
            kv_to_main_ms=r.main_kv_ms, handoff_position=r.handoff_at or 0, queued_ms=r.queued_ms))
