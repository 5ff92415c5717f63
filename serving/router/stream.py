"""The user's token stream: the tiers' Decode streams in, GenerateResponses out.

  - the tiers' batches arrive in the request's inbox (`Request.relay_out` / `main_out`,
    `request.Inbox`) from their instances' DecodeStreams (`decode_streams.Subscription`); a
    broken stream becomes an `Abort` there, or what its `on_error` makes of it (pdd's RLD: MD
    taking over, `recovery.take_over`);
  - `expire` puts the client's deadline into the inbox (the stream fails DEADLINE_EXCEEDED
    even when no tier reports it);
  - `Output` reads the relay batches while the request is RELAY_STREAMING or RELAY_LOST, then
    (after a batch `handed_off`, or MD caught up: MAIN_STREAMING) the main ones, as they arrive
    (on the DecodeStream reader's stack, not on the request's own task), checks every batch's
    position (no gap, duplicate or reorder), decodes text incrementally (`detok.IncrementalText`: an
    incomplete UTF-8 sequence and a possible stop string's start held back; stop strings end
    the stream), books RLD's decode speed, and groups the deltas per the request's stream
    interval (`interval.Group`: the first tokens and the last message at once);
  - `Output.messages` wakes when a message is ready, builds it (usage and timings on the last;
    its tokens timed as sent: TTFT, ITL) and yields it. The caller settles the request when it
    gets the last message, before passing it on.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING

import grpc

from serving.pb import cluster_pb2, common_pb2, router_pb2
from serving.router.ahead import Ahead, Verdict
from serving.router.batch_checks import check_logprobs, cut_to, ends_stream
from serving.router.detok import IncrementalText
from serving.router.interval import Delta, Group, join, joins
from serving.router.message import Messages
from serving.router.request import PIPELINE_NAMES, Abort, Request
from serving.router.request_state import State
from serving.router.tools import ToolText

if TYPE_CHECKING:
    from serving.router.metrics import RouterMetrics


# The longest the user waits on MD once RLD's batches are held back (Verdict.WAIT); then RLD goes on.
HOLD_MAX_S = 1.0


def expire(*queues: asyncio.Queue) -> None:
    """The client's deadline passed: the stream fails with DEADLINE_EXCEEDED (then releases all)."""
    for q in queues:
        q.put_nowait(Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed before it finished"))


class Output:
    """One request's outgoing stream, from a request already streaming (RELAY_STREAMING or
    MAIN_STREAMING). `tokenizer` None: no text; `stop_strings` end it early; `on_switch()` runs
    once when the stream moves from RLD to MD (the caller releases RLD); `await on_hold(hold)`
    pauses RLD's decoding of the request while RLD's batches are held back, and resumes it if
    RLD keeps the request (the caller's Hold RPC, errors its own); `give_up()`, asked at RLD's
    batches while MD has nothing to judge yet, -> True once the caller gave MD up (give_up.py)."""

    def __init__(self, r: Request, tokenizer, stop_strings, metrics: RouterMetrics, on_switch=None, on_hold=None,
                 give_up=None):
        self.r, self.timer = r, metrics.timer(r.t0)
        self.text = IncrementalText(tokenizer, stop_strings)  # O(batch) per batch
        self.build = Messages(r, tokenizer)  # Delta -> GenerateResponse
        self.tools = ToolText(r.tools) if r.tools is not None else None  # tool calls read out of the text
        self.on_switch = on_switch
        # messages grouped per the stream interval; where RLD / MD hold the tokens to it (StreamHold) with
        # a time bound, a batch short of K waited the bound there already: each goes as it comes
        self.group = Group() if r.interval_at_source and r.stream_interval[1] else Group(*r.stream_interval)
        self.ahead = Ahead(r.label, r.wants_logprobs)  # MD's tokens while RLD is the source
        self.relay_held: list | None = None  # RLD's items held back while the user waits for MD (Verdict.WAIT)
        self.hold_until = 0.0  # perf_counter after which RLD's held items go on and MD is dropped
        self.pending: collections.deque = collections.deque()  # held items to read again, before the queue's
        self.on_hold = on_hold  # async (hold: bool) -> None: RLD pauses / resumes the request (its Hold RPC)
        self._hold_sent: asyncio.Task | None = None  # the last Hold sent (each waits for the one before)
        self.give_up = give_up  # () -> bool: MD is given up (router/give_up.py), the stream stays on RLD
        self.wants_logprobs = r.wants_logprobs  # fixed once the request is read
        self.pipeline_name = PIPELINE_NAMES[r.pipeline]  # the metrics' label (the pipeline is chosen by now)
        self.outbox: collections.deque = collections.deque()  # Deltas ready to send; an exception ends the stream
        self.finish = 0  # the finish reason readied (-1: the stream failed): nothing is read after it
        self._waiter: asyncio.Future | None = None  # `messages` waiting for the outbox
        self._wait_due: float | None = None  # the bound it waits with

    @property
    def on_main(self) -> bool:
        """The user's tokens come from MD now (else from RLD, lost or not)."""
        return self.r.state is State.MAIN_STREAMING

    async def messages(self):
        """-> GenerateResponses until (and with) the one that has a finish_reason. While RLD is the
        source, MD's batches (it emits from the final handoff on, RLD decoding on) are held by
        position (`ahead.Ahead`); once MD agrees and is close, RLD's batches are held back until
        MD covers every token the user has, then the stream moves to MD; if MD proves different
        (or is later than HOLD_MAX_S), RLD's held batches go on and RLD keeps the request. RLD's
        own handed_off batch (one-shot, or MD taking over a broken RLD) switches at once.

        The batches are read where they arrive: the request's inbox runs `_feed` as each comes
        (`request.Inbox`, on the putter's stack), and this generator wakes only when a
        message is ready (`outbox`), or a held message's bound or the hold on RLD runs out. So
        at K tokens a message the request's task wakes once per K tokens, not per batch."""
        self.r.out.listen(self._feed)
        try:
            self._feed()  # what arrived before the stream began
            while True:
                if not self.outbox:
                    if await self._wait():
                        continue
                    self._guarded(None)  # a bound ran out
                    self._feed()  # RLD's held items, if the hold ended, then anything queued
                    continue
                d = self.outbox.popleft()
                if isinstance(d, BaseException):
                    raise d
                while self.outbox and not d.finish_reason and joins(d, self.outbox[0]):
                    join(d, self.outbox.popleft())  # the user fell behind: what is ready goes as one
                msg = self._response(d)
                yield msg
                if msg.finish_reason:
                    return
        finally:
            self.r.out.listen(None)

    async def _wait(self) -> bool:
        """Until `_feed` readied a message (-> True) or a held message's bound, or the hold on
        RLD's batches, passes first (-> False)."""
        due = self._wait_due = self._due()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            if due is None:
                await self._waiter
                return True
            async with asyncio.timeout(max(0.0, due - time.perf_counter())):
                await self._waiter
            return True
        except TimeoutError:
            return False
        finally:
            self._waiter = None

    def _feed(self) -> None:
        """Every item that arrived (RLD's held items first) through `_step`; wakes `messages`
        once something is ready to send."""
        while not self.finish and (self.pending or not self.r.out.empty()):
            items = [self._get_nowait()]
            while self._ready() and not ends_stream(items[-1][1]):
                items.append(self._get_nowait())
            self._guarded(items)
        if (self._waiter is not None and not self._waiter.done()
                and (self.outbox or self.finish or self._due() != self._wait_due)):
            self._waiter.set_result(None)  # something to send, or a new bound to wait for

    def _due(self) -> float | None:
        """When `messages` must wake with nothing new: a held message's bound, the hold on RLD."""
        due = self.group.due
        if self.relay_held is not None:
            due = self.hold_until if due is None else min(due, self.hold_until)
        return due

    def _guarded(self, items: list | None) -> None:
        """`_step`; what it raises ends the stream, after what was ready before it."""
        if self.finish:
            return
        try:
            self._step(items)
        except Exception as e:  # noqa: BLE001  (an Abort, or a fault: the user's stream fails with it)
            self.finish = -1
            self.outbox.append(e)

    def _step(self, items: list | None) -> None:
        """Arrived items, in order (None: a bound ran out) -> the outbox's next Deltas, if any."""
        r, group = self.r, self.group
        new, lps, switch, finish = [], [], False, common_pb2.FINISH_REASON_UNSPECIFIED
        if items is None:
            if group.due is not None and group.due <= time.perf_counter():
                self.outbox.append(group.take())
            items = ()
        on_main = self.on_main  # only `_judge`, after these items, moves the stream
        for role, it in items:
            if (role == common_pb2.ROLE_MAIN) != on_main:
                if not on_main:
                    self.ahead.add(it)
                continue  # RLD's batches after the switch: it is being released
            if self.relay_held is not None:  # the user waits for MD: RLD's batches held back
                self.relay_held.append((role, it))
                continue
            if isinstance(it, Abort):
                raise it
            if on_main:  # MD's stream may overlap what the user has (it started behind)
                it = cut_to(it, len(r.tokens) + len(new), r.tokens)
                if it is None:
                    continue
            if it.token_ids and it.start_position != len(r.tokens) + len(new):
                raise Abort(grpc.StatusCode.INTERNAL, f"token stream out of order at position {it.start_position}")
            if self.wants_logprobs:
                check_logprobs(it, role, r.first_logprob)
            new += it.token_ids
            lps += it.logprobs
            switch = switch or it.handed_off
            finish = finish or it.finish_reason
        if new or finish:
            self._ready_delta(self._delta(new, finish, lps, on_main))
        if not self.finish and not on_main and self._judge(switch):
            held = self._take_ahead()
            if held is not None:  # the stream is MD's now
                self._ready_delta(self._delta(list(held.token_ids), held.finish_reason, list(held.logprobs), True))

    def _ready_delta(self, d: Delta) -> None:
        if d.finish_reason:
            self.finish = d.finish_reason
        if (d := self.group.add(d)) is not None:
            self.outbox.append(d)

    def _judge(self, switch: bool) -> bool:
        """(RLD is the source.) Move the stream to MD (-> True), start or end holding RLD's
        batches back, per `ahead.verdict`; `switch`: RLD handed the request off (always moves)."""
        r = self.r
        per_token = (r.relay_t1 - r.relay_t0) / r.relay_after if r.relay_after else 0.05  # RLD's pace, s
        verdict = Verdict.SWITCH if switch else self.ahead.verdict(r.tokens, per_token)
        if verdict is Verdict.SWITCH:
            self.relay_held = None  # RLD's held batches are dropped: it is released
            self._switch()
            return True
        if verdict is Verdict.PENDING and self.relay_held is None and self.give_up is not None and self.give_up():
            self.ahead.drop()  # the request ends on RLD before MD could catch up
            return False
        if verdict is Verdict.WAIT and self.relay_held is None:
            self.relay_held, self.hold_until = [], time.perf_counter() + HOLD_MAX_S
            self._hold_relay(True)
        elif self.relay_held is not None and (verdict is Verdict.NO or time.perf_counter() >= self.hold_until):
            self.ahead.drop(f"MD did not reach the user's position {len(r.tokens)} within {HOLD_MAX_S} s")
            self.pending.extend(self.relay_held)  # RLD's held batches go on, in order
            self.relay_held = None
            self._hold_relay(False)
        return False

    def _hold_relay(self, hold: bool) -> None:
        """RLD pauses (`hold`) or resumes the request, in the background, in the order asked."""
        if self.on_hold is None:
            return
        before, on_hold = self._hold_sent, self.on_hold

        async def send() -> None:
            if before is not None:
                await asyncio.gather(before, return_exceptions=True)
            await on_hold(hold)

        self._hold_sent = asyncio.create_task(send())

    def _ready(self) -> bool:
        return bool(self.pending) or not self.r.out.empty()

    def _get_nowait(self):
        return self.pending.popleft() if self.pending else self.r.out.get_nowait()

    def _delta(self, new: list[int], finish: int, lps: list, on_main: bool) -> Delta:
        """Books `new` tokens (text, stop strings, tool calls) -> what they add to the stream
        (finish_reason STOP once a stop string ended the text, TOOL_CALLS if a tool was called)."""
        source = common_pb2.ROLE_MAIN if on_main else common_pb2.ROLE_RELAY
        sources = [source] * len(new)
        text, stop = self._add(new, sources, bool(finish))
        calls = ()
        if self.tools is not None:
            text, calls = self.tools.add(text, bool(stop or finish))
        if stop:
            finish = common_pb2.FINISH_REASON_STOP
        if finish == common_pb2.FINISH_REASON_STOP and self.tools is not None and self.tools.called:
            finish = common_pb2.FINISH_REASON_TOOL_CALLS
        return Delta(new, sources, text, lps, calls, finish)

    def _response(self, d: Delta) -> router_pb2.GenerateResponse:
        """The message that carries `d` (usage and timings on the last), its tokens timed as sent."""
        msg = self.build(d)
        self.timer.tokens(self.pipeline_name, len(d.token_ids))
        return msg

    def _switch(self) -> None:
        self.r.advance(State.MAIN_STREAMING)
        self.r.handoff_at = len(self.r.tokens)
        self.timer.switch()  # the next batch's gap: pddjax_router_handoff_gap_seconds
        if self.on_switch is not None:
            self.on_switch()

    def _take_ahead(self):
        """At the switch: MD's held tokens as one batch from the user's position (the overlap
        checked by `cut_to`), or None if they hold nothing for it."""
        ahead = self.ahead
        tokens, ahead.tokens = ahead.tokens, None
        if not tokens:
            return None
        held = cut_to(cluster_pb2.TokenBatch(start_position=ahead.at, token_ids=tokens, finish_reason=ahead.finish,
                                             logprobs=ahead.logprobs), len(self.r.tokens), self.r.tokens)
        return held if held is not None and held.start_position == len(self.r.tokens) else None

    def _add(self, new: list[int], sources: list[int], final: bool) -> tuple[str, bool]:
        """Books `new` tokens from `sources` (one tier's, a source per token: times, text) ->
        (their text, a stop string ended the text)."""
        r, now = self.r, time.perf_counter()
        if r.ttft is None and new:
            r.ttft = now - r.t0
        if new and sources[0] == common_pb2.ROLE_RELAY:  # RLD's decode speed, after its first batch
            r.relay_t0 = r.relay_t0 or now
            r.relay_after += len(new) if now > r.relay_t0 else 0
            r.relay_t1 = now
        r.tokens += new
        r.sources += sources
        return self.text.add(r.tokens, final)
