"""The user's token stream: the tiers' Decode streams in, GenerateResponses out.

  - the tiers' batches arrive in the request's queue (`Request.relay_out` / `main_out`) from
    their instances' DecodeStreams (`decode_streams.Subscription`); a broken stream becomes an
    `Abort` there, or what its `on_error` makes of it (pdd's RLD: MD taking over,
    `recovery.take_over`);
  - `expire` puts the client's deadline into the queues (the stream fails DEADLINE_EXCEEDED
    even when no tier reports it);
  - `Output.messages` reads the relay queue while the request is RELAY_STREAMING or
    RELAY_LOST, then (after a batch `handed_off`, or MD caught up: MAIN_STREAMING) the main one,
    checks every batch's position (no gap, duplicate or reorder), decodes text incrementally
    (`detok.IncrementalText`: an incomplete UTF-8 sequence and a possible stop string's start
    held back; stop strings end the stream), times tokens (TTFT, ITL, RLD's decode speed), and
    puts usage and timings on the last message; `interval.Group` groups the messages per the
    request's stream interval (the first tokens and the last message at once). The caller
    settles the request when it gets that message, before passing it on.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TYPE_CHECKING

import grpc

from serving.pb import cluster_pb2, common_pb2, router_pb2
from serving.router import token_bytes
from serving.router.detok import IncrementalText
from serving.router.interval import Group
from serving.router.request import PIPELINE_NAMES, Abort, Request
from serving.router.request_state import State
from serving.router.tools import ToolText

if TYPE_CHECKING:
    from serving.router.metrics import RouterMetrics


# The stream moves to MD once MD is at most SWITCH_LAG tokens behind the user, or its lag costs
# the user at most SWITCH_WAIT_S at RLD's pace (a fast model lags more tokens in the same time);
# FORCE_AFTER_S after MD's first batch (MD does not gain on RLD) a wait up to FORCE_WAIT_S is taken.
SWITCH_LAG, SWITCH_WAIT_S = 1, 0.1
FORCE_AFTER_S, FORCE_WAIT_S = 0.5, 0.4


def expire(*queues: asyncio.Queue) -> None:
    """The client's deadline passed: the stream fails with DEADLINE_EXCEEDED (then releases all)."""
    for q in queues:
        q.put_nowait(Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed before it finished"))


def _terminal(item) -> bool:
    return isinstance(item, Abort) or bool(item.finish_reason) or item.handed_off


class Output:
    """One request's outgoing stream, from a request already streaming (RELAY_STREAMING or
    MAIN_STREAMING). `tokenizer` None: no text; `stop_strings` end it early; `on_switch()` runs
    once when the stream moves from RLD to MD (the caller releases RLD)."""

    def __init__(self, r: Request, tokenizer, stop_strings, metrics: RouterMetrics, on_switch=None):
        self.r, self.timer = r, metrics.timer(r.t0)
        self.text = IncrementalText(tokenizer, stop_strings)  # O(batch) per batch
        self.tokenizer, self._texts = tokenizer, {}  # token id -> its text alone (logprobs' token strings)
        self.tools = ToolText(r.tools) if r.tools is not None else None  # tool calls read out of the text
        self.on_switch = on_switch
        self.group = Group(*r.stream_interval)  # messages grouped per the stream interval
        self.ahead: list[int] | None = []  # MD's tokens while RLD is the source (None: MD disagreed or failed)
        self.ahead_lps: list = []  # their logprobs (when the request asked)
        self.ahead_at = 0  # output position of ahead[0]
        self.main_finish = common_pb2.FINISH_REASON_UNSPECIFIED  # MD finished within `ahead`
        self.ahead_t0 = 0.0  # when MD's first batch came (perf_counter)

    @property
    def on_main(self) -> bool:
        """The user's tokens come from MD now (else from RLD, lost or not)."""
        return self.r.state is State.MAIN_STREAMING

    async def messages(self):
        """-> GenerateResponses until (and with) the one that has a finish_reason. While RLD is the
        source, MD's batches (it emits from the final handoff on, RLD decoding on) are held by
        position; the stream moves to MD once MD is within SWITCH_LAG tokens of the user (its next
        token is at most about one interval away), or its lag costs at most SWITCH_WAIT_S (more
        once FORCE_AFTER_S passed), after checking the overlap token for token. RLD's own
        handed_off batch (one-shot, or MD taking over a broken RLD) switches at once."""
        r, group = self.r, self.group
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        while not finish:
            item = await self._next()
            if item is None:  # the held message's oldest token waited the interval's bound
                yield group.take()
                continue
            items = [item]
            while not r.out.empty() and not _terminal(items[-1][1]):
                items.append(r.out.get_nowait())
            new, lps, switch = [], [], False
            for role, it in items:
                if (role == common_pb2.ROLE_MAIN) != self.on_main:
                    if not self.on_main:
                        self._hold_main(it)
                    continue  # RLD's batches after the switch: it is being released
                if isinstance(it, Abort):
                    raise it
                if self.on_main:  # MD's stream may overlap what the user has (it started behind)
                    it = self._from(it, len(r.tokens) + len(new))
                    if it is None:
                        continue
                if it.token_ids and it.start_position != len(r.tokens) + len(new):
                    raise Abort(grpc.StatusCode.INTERNAL, f"token stream out of order at position {it.start_position}")
                self._check_logprobs(it, role)
                new += it.token_ids
                lps += it.logprobs
                switch = switch or it.handed_off
                finish = finish or it.finish_reason
            if new or finish:
                msg = self._message(new, finish, lps)
                finish = msg.finish_reason
                if (msg := group.add(msg)) is not None:
                    yield msg
            if not finish and (switch or (not self.on_main and self._main_caught_up())):
                self._switch()
                held = self._take_ahead()
                if held is not None:
                    msg = self._message(list(held.token_ids), held.finish_reason, list(held.logprobs))
                    finish = msg.finish_reason
                    if (msg := group.add(msg)) is not None:
                        yield msg

    async def _next(self):
        """The queue's next item; None once a held message's bound passes first."""
        q, due = self.r.out, self.group.due
        if due is None or not q.empty():
            return await q.get()
        try:
            async with asyncio.timeout(due - time.perf_counter()):
                return await q.get()
        except TimeoutError:
            return None

    def _check_logprobs(self, it, role: int) -> None:
        """A batch of a request that asked for logprobs carries one per token (P's first token
        filled in from its Prefilled when the batch is MD's take-over that starts with it)."""
        if not self.r.wants_logprobs or len(it.logprobs) == len(it.token_ids):
            return
        if (not it.logprobs and it.start_position == 0 and it.token_ids and self.r.first_logprob is not None
                and len(it.token_ids) == 1):
            it.logprobs.append(self.r.first_logprob)
            return
        name = "MD" if role == common_pb2.ROLE_MAIN else "RLD"
        raise Abort(grpc.StatusCode.INTERNAL, f"{name} sent {len(it.token_ids)} tokens with {len(it.logprobs)} "
                                              f"logprobs at position {it.start_position}")

    def _message(self, new: list[int], finish: int, lps: list) -> router_pb2.GenerateResponse:
        source = common_pb2.ROLE_MAIN if self.on_main else common_pb2.ROLE_RELAY
        delta, stop = self._add(new, source, bool(finish))
        calls = []
        if self.tools is not None:
            delta, calls = self.tools.add(delta, bool(stop or finish))
        msg = router_pb2.GenerateResponse(request_id=self.r.label, token_ids=new, sources=[source] * len(new),
                                          text=delta, logprobs=lps, tool_calls=calls)
        if lps and self.tokenizer is not None:
            exact = token_bytes.get(self.tokenizer)  # None until built (token_bytes.build, at the router's start)
            for tok, lp in zip(new, msg.logprobs):
                lp.token = self._text(tok)
                lp.top_tokens.extend(self._text(t) for t in lp.top_ids)
                if exact is not None:
                    lp.token_bytes = exact([tok])
                    lp.top_token_bytes.extend(exact([t]) for t in lp.top_ids)
        if stop or finish:
            msg.finish_reason = common_pb2.FINISH_REASON_STOP if stop else finish
            if self.tools is not None and self.tools.called and msg.finish_reason == common_pb2.FINISH_REASON_STOP:
                msg.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS
            self._summary(msg)
        return msg

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _hold_main(self, it) -> None:
        """An MD batch while RLD is the source: keep its tokens by position (contiguous)."""
        if self.ahead is None:
            return
        if isinstance(it, Abort):  # MD failed before the switch: RLD goes on alone
            self.ahead = None
            return
        if it.token_ids:
            if self.r.wants_logprobs and len(it.logprobs) != len(it.token_ids):
                self.ahead = None  # MD's batch lacks logprobs: never switch on it
                return
            if not self.ahead:
                self.ahead_at, self.ahead_t0 = it.start_position, time.perf_counter()
                self.ahead_lps = []
            elif it.start_position != self.ahead_at + len(self.ahead):
                self.ahead = None  # a hole in MD's stream: never switch on it
                return
            self.ahead += it.token_ids
            self.ahead_lps += it.logprobs
        self.main_finish = self.main_finish or it.finish_reason

    def _main_caught_up(self) -> bool:
        """MD holds tokens up to within SWITCH_LAG of the user's next position, and the ones
        the user has already agree with them (a heterogeneous pair may differ: then RLD stays)."""
        r, ahead = self.r, self.ahead
        if not ahead or self.ahead_at > len(r.tokens):
            return False
        seen = r.tokens[self.ahead_at:self.ahead_at + len(ahead)]
        if ahead[:len(seen)] != seen:
            at = next(i for i, (a, b) in enumerate(zip(ahead, seen)) if a != b)
            print(f"router: {r.label}: MD's token {ahead[at]} at position {self.ahead_at + at} differs from RLD's "
                  f"{seen[at]}: the stream stays on RLD", file=sys.stderr, flush=True)
            self.ahead = None
            return False
        lag = len(r.tokens) - (self.ahead_at + len(ahead))  # tokens MD still has to make to reach the user
        per_token = (r.relay_t1 - r.relay_t0) / r.relay_after if r.relay_after else 0.05  # RLD's pace, s
        late = time.perf_counter() - self.ahead_t0 > FORCE_AFTER_S  # MD does not gain on RLD: RLD stops
        wait = lag * per_token
        return (lag <= SWITCH_LAG or wait <= SWITCH_WAIT_S or (late and wait <= FORCE_WAIT_S)
                or bool(self.main_finish))

    def _switch(self) -> None:
        self.r.advance(State.MAIN_STREAMING)
        self.r.handoff_at = len(self.r.tokens)
        self.timer.switch()  # the next batch's gap: pddjax_router_handoff_gap_seconds
        if self.on_switch is not None:
            self.on_switch()

    def _take_ahead(self):
        """At the switch: MD's held tokens as one batch from the user's position (the overlap
        checked by `_from`), or None if they hold nothing for it."""
        ahead, self.ahead = self.ahead, None
        if not ahead:
            return None
        held = self._from(cluster_pb2.TokenBatch(start_position=self.ahead_at, token_ids=ahead,
                                                 finish_reason=self.main_finish, logprobs=self.ahead_lps),
                          len(self.r.tokens))
        return held if held is not None and held.start_position == len(self.r.tokens) else None

    def _from(self, it, position: int):
        """An MD batch after the switch, cut to start at `position` (the part the user has is
        checked against it); None if it holds nothing new."""
        if not it.token_ids or it.start_position >= position:
            return it
        have = min(position - it.start_position, len(it.token_ids))  # tokens of it the user has
        if list(it.token_ids[:have]) != self.r.tokens[it.start_position:it.start_position + have]:
            raise Abort(grpc.StatusCode.INTERNAL, f"MD's tokens disagree with the stream at {it.start_position}")
        if have == len(it.token_ids):  # nothing new; its finish counts only where the user's tokens end
            at_end = it.finish_reason and it.start_position + have == position
            return cluster_pb2.TokenBatch(start_position=position, finish_reason=it.finish_reason) if at_end else None
        return cluster_pb2.TokenBatch(start_position=position, token_ids=it.token_ids[have:],
                                      finish_reason=it.finish_reason, logprobs=it.logprobs[have:])

    def _add(self, new: list[int], source: int, final: bool) -> tuple[str, bool]:
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
        return self.text.add(r.tokens, final)

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
