"""The handoff between the Decode services: RLD's Handoff RPC and MD's HandoffTokens.

  Handoff      (RLD) hand token IDs to MD.
               chunked (the default): catch-up chunks while more than the threshold is
               pending (MD extends each in one step, then decodes ahead of RLD, held), then
               the final chunk, all while RLD decodes on and streams: nothing on the user's
               path waits for the WAN. MD emits from the final's end; the router holds MD's
               batches by position and moves the user's stream to MD once MD has caught up
               (serving/router/stream.py), then releases RLD. A chunk that fails leaves RLD
               the request: it never paused.
               one-shot: RLD pauses, hands everything in one final, MD acknowledges, RLD's
               stream ends with handed_off_at = N. Its tries share HANDOFF_FINAL_SECONDS (the
               user waits meanwhile), after which RLD resumes.
               Each HandoffTokens try is retried when its connection breaks or its answer is lost.
               MD's address comes with the request: one that is not HOST:PORT is INVALID_ARGUMENT,
               one outside `[relay] handoff_peers` (when set) PERMISSION_DENIED, both before any
               channel opens; at most MD_CHANNELS channels are kept (rpc.PeerChannels).
  HandoffTokens (MD) append RLD's tokens and extend-decode them; a non-final chunk is
               acknowledged once MD has caught up on it; on the final one MD emits from N on.
               Applied once per (request, chunk_seq | final): the table of applied chunks
               outlives the slot, and MD answers a repeat like the first; a second final that
               agrees with MD's tokens (the router taking over a broken RLD) is answered with
               where MD's stream starts and the tokens the caller lacks.
"""

from __future__ import annotations

import array
import asyncio
import collections
import sys
import zlib
from typing import TYPE_CHECKING

import grpc

from pddjax import env
from serving import rpc
from serving.call_link import CallStub, PeerLinks
from serving.engine.slot import RpcFailure, SlotState
from serving.engine.worker import resolve
from serving.pb import cluster_pb2, common_pb2

if TYPE_CHECKING:
    from serving.engine.slot import Slot, SlotTable
    from serving.engine.worker import EngineWorker

# Timeouts (pddjax.env): HANDOFF_TIMEOUT_SECONDS per try of a non-final chunk; HANDOFF_FINAL_SECONDS
# for the final chunk's tries together (RLD is paused meanwhile, so a slow or lost MD resumes RLD
# soon); DECODING_WAIT_SECONDS: how long a Handoff waits for RLD to start decoding (its KV to land).
# Chunks before the final one: each is acknowledged once MD caught up, and the tail shrinks while
# MD keeps pace; an MD slower than RLD would chase forever, so the final goes after this many.
MAX_CATCH_UP_CHUNKS = 8
HANDOFF_RETRY_WAITS = (0.2, 0.5, 1.0)  # before each retry of the same chunk (MD applies it once)
HANDOFFS_REMEMBERED = 10000  # MD: applied handoff chunks (a retry is answered, never applied twice)
MD_CHANNELS = 32  # RLD: channels to MD kept open (one per MD address; the least recently used idle one closes)


class HandoffLate(Exception):
    """The final chunk's budget ran out (RLD resumes); the message is one sentence."""


class Handoff:
    """Both ends of the handoff for one Decode service: `handoff` (on RLD) and `handoff_tokens`
    (on MD), for the requests reserved in `slots`, through `worker`. `role` names this service
    in log lines and error messages; token ids at or past `vocab_size` are refused; `peers`: the
    MD addresses RLD may hand off to (empty: any HOST:PORT)."""

    def __init__(self, role: str, worker: EngineWorker, slots: SlotTable, vocab_size: int, peers=()):
        self.role, self.worker, self.slots, self.vocab_size = role, worker, slots, vocab_size
        self.peers = frozenset(peers)
        self.channels = rpc.PeerChannels(MD_CHANNELS, rpc.PEER_CHANNEL_OPTIONS)  # RLD: MD's address -> channel
        self.links = PeerLinks(self.channels)  # RLD: MD's address -> its Calls stream (HandoffTokens)
        # MD: (request, chunk_seq | "final") -> ((start, n, tokens' crc), ack future); outlives
        # the slot, so a retry whose answer was lost is answered even after the request finished here
        self.applied: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()

    async def handoff(self, request, context) -> cluster_pb2.HandoffResponse:
        """RLD: hand the request's token IDs to MD. Chunked: catch-up chunks, then the final,
        RLD decoding on throughout (the router releases RLD once MD's stream has caught up).
        One-shot: RLD pauses, hands everything, and its stream ends with handed_off_at."""
        rid = request.request_id
        self.slots.touch(rid)
        slot = self.slots.get(rid)
        if slot is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request {rid} is not on {self.role}")
        address = request.main_address
        problem = rpc.address_problem(address)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the handoff of {rid} cannot go to MD: {problem}")
        if self.peers and address not in self.peers:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{address} is not one of this relay's "
                                                                   "handoff peers ([relay] handoff_peers)")
        # MD may hold its KV before RLD does (a large DRC hit): hand off only once RLD decodes,
        # waiting no longer than the caller's deadline or DECODING_WAIT_SECONDS
        remaining = rpc.time_left(context)
        limit = env.DECODING_WAIT_SECONDS.get()
        wait = limit if remaining is None else min(remaining, limit)
        try:
            await asyncio.wait_for(slot.started.wait(), wait)  # DECODING (or CLOSED: found gone below)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{rid} did not start decoding on {self.role} "
                                                                   f"within {wait:.0f} s (its KV has not arrived)")
        async with self.channels.use(address) as ch:  # never closed while this handoff uses it
            return await self._hand_over(request, context, self.links.stub(address, ch))

    async def _hand_over(self, request, context, main: CallStub) -> cluster_pb2.HandoffResponse:
        """RLD, decoding: `handoff`'s catch-up chunks and final to MD through `main`."""
        rid = request.request_id
        chunked = request.mode == common_pb2.HANDOFF_MODE_CHUNKED
        threshold = request.threshold or 64
        sent, chunks = 0, 0
        while True:
            toks = await self.worker.call(_snapshot, rid, urgent=True)
            if toks is None:  # RLD finished first
                return cluster_pb2.HandoffResponse(handed_off=False, chunks=chunks, tokens=sent)
            if chunked and len(toks) - sent > threshold and chunks < MAX_CATCH_UP_CHUNKS:
                await self._send_tokens(main, cluster_pb2.HandoffTokensRequest(
                    request_id=rid, start_position=sent, token_ids=toks[sent:], final=False, chunk_seq=chunks))
                sent, chunks = len(toks), chunks + 1
                continue
            if chunked:  # the final without a pause: MD emits from its end while RLD decodes on, and
                # the router moves the user's stream to MD once MD is as far (then releases RLD)
                await self._send_tokens(main, cluster_pb2.HandoffTokensRequest(
                    request_id=rid, start_position=sent, token_ids=toks[sent:], final=True, chunk_seq=chunks))
                return cluster_pb2.HandoffResponse(handed_off=True, handed_off_at=len(toks), chunks=chunks + 1,
                                                   tokens=len(toks))
            toks = await self.worker.call(_pause, rid, self.slots, urgent=True)
            if toks is None:
                return cluster_pb2.HandoffResponse(handed_off=False, chunks=chunks, tokens=sent)
            try:
                await self._send_tokens(main, cluster_pb2.HandoffTokensRequest(
                    request_id=rid, start_position=sent, token_ids=toks[sent:], final=True, chunk_seq=chunks),
                    budget=env.HANDOFF_FINAL_SECONDS.get())
            except BaseException as e:
                self.worker.run_soon(_resume, rid, self.slots, urgent=True)  # MD failed or late: RLD finishes it
                if isinstance(e, HandoffLate):
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
                raise
            await self.worker.call(self._handed_off, rid, len(toks))
            return cluster_pb2.HandoffResponse(handed_off=True, handed_off_at=len(toks), chunks=chunks + 1,
                                               tokens=len(toks))

    async def _send_tokens(self, main: CallStub, req, budget: float | None = None) -> None:
        """RLD: one HandoffTokens, retried when the connection breaks or the answer is lost
        (UNAVAILABLE, DEADLINE_EXCEEDED): MD keys it by (request, chunk_seq | final) and applies
        it once, answering a retry with the first attempt's acknowledgement. `budget`: all tries
        within this many seconds (each try gets what is left), else HANDOFF_TIMEOUT_SECONDS each."""
        loop = asyncio.get_running_loop()
        end = None if budget is None else loop.time() + budget
        for wait in (*HANDOFF_RETRY_WAITS, None):
            timeout = env.HANDOFF_TIMEOUT_SECONDS.get() if end is None else end - loop.time()
            try:
                if timeout <= 0:
                    raise TimeoutError
                await main.HandoffTokens(req, timeout=timeout)
                return
            except TimeoutError:
                raise HandoffLate(f"MD did not take the final handoff of {req.request_id} within {budget} s; "
                                  "RLD decodes on") from None
            except grpc.aio.AioRpcError as e:
                late = end is not None and loop.time() + (wait or 0) >= end
                if wait is None or late or e.code() not in (grpc.StatusCode.UNAVAILABLE,
                                                            grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                print(f"{self.role}: handoff {req.request_id} chunk {req.chunk_seq} (final={req.final}) failed "
                      f"({e.code().name}); retrying in {wait} s", file=sys.stderr, flush=True)
                await asyncio.sleep(wait)

    def _handed_off(self, e, rid, n):
        """Engine thread (RLD): MD took over at output position n; end the stream and release."""
        slot = self.slots.get(rid)
        if slot is not None:
            self.slots.close(slot, cluster_pb2.TokenBatch(start_position=n, handed_off=True, handed_off_at=n))

    async def handoff_tokens(self, request, context) -> cluster_pb2.HandoffTokensResponse:
        """MD: append RLD's token IDs (extend-decode them); ack a chunk once caught up."""
        rid = request.request_id
        self.slots.touch(rid)
        bad = [t for t in request.token_ids if t >= self.vocab_size]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"handoff token {bad[0]} of {rid} is outside "
                                                                  f"the vocabulary [0, {self.vocab_size})")
        key = (rid, "final" if request.final else request.chunk_seq)
        sig = (request.start_position, len(request.token_ids), zlib.crc32(array.array("I", request.token_ids)))
        if key in self.applied:  # a retry whose answer was lost, or a duplicate: applied once only
            first, prev = self.applied[key]
            if first != sig:
                if request.final:  # the router taking over after RLD died past this final's ack?
                    rest = await self.worker.call(_behind_final, rid, request.start_position,
                                                  list(request.token_ids), self.slots, urgent=True)
                    if rest is not None:
                        emit_from, toks = rest
                        return cluster_pb2.HandoffTokensResponse(caught_up_to=emit_from, emit_from=emit_from,
                                                                 token_ids=toks)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"handoff {key[1]} of {rid} was already applied with other tokens")
            caught = await asyncio.shield(prev)
            if isinstance(caught, RpcFailure):
                await context.abort(caught.code, caught.message)
            return cluster_pb2.HandoffTokensResponse(caught_up_to=max(caught, 0))
        if rid not in self.slots:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request {rid} is not on {self.role}")
        fut = asyncio.get_running_loop().create_future()
        self.applied[key] = (sig, fut)
        while len(self.applied) > HANDOFFS_REMEMBERED:
            self.applied.popitem(last=False)

        def apply(e):
            seq, slot = e.seqs.get(rid), self.slots.get(rid)
            if seq is None or slot is None or slot.closed:
                raise KeyError(rid)
            start, toks = request.start_position, list(request.token_ids)
            if request.final and start + len(toks) == 0:
                raise ValueError(f"the final handoff for {rid} carries no token")
            if start > len(seq.generated):
                raise ValueError(f"handoff for {rid} starts at {start} but MD knows {len(seq.generated)} tokens")
            for i, t in enumerate(toks):  # tokens sampled here ahead of RLD must agree
                p = start + i
                if p < len(seq.generated) and seq.generated[p] != t:
                    seq.rollback(p)
                    break
            seq.append_known(start, toks)
            seq.paused = False
            if not request.final:
                _running(slot)
            end = start + len(toks)
            if request.final:
                self.slots.decode(slot, end)
                fut.get_loop().call_soon_threadsafe(resolve, fut, min(seq.pages.num_tokens - len(seq.prompt), end))
            elif seq.pages.num_tokens >= len(seq.prompt) + end or seq.finish_reason:
                fut.get_loop().call_soon_threadsafe(resolve, fut, end)
            else:
                slot.waiters.append((len(seq.prompt) + end, fut))

        try:
            await self.worker.call(apply, urgent=True)  # never behind other requests' KV imports
        except (KeyError, ValueError) as e:
            failure = (RpcFailure(grpc.StatusCode.NOT_FOUND, f"request {rid} is no longer on {self.role}")
                       if isinstance(e, KeyError) else RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
            self.applied.pop(key, None)
            resolve(fut, failure)  # a duplicate waiting on this attempt fails alike
            await context.abort(failure.code, failure.message)
        caught = await fut
        return cluster_pb2.HandoffTokensResponse(caught_up_to=max(caught, 0))


def _behind_final(e, rid, start, toks, slots):
    """Engine thread (MD): a second final for a request whose final was applied (the router
    taking over a broken RLD, with the tokens the user has). If they agree with MD's, ->
    (emit_from, the tokens from the caller's end up to emit_from; none when the caller is past
    it): the stream goes on from there. Tokens past what MD made (RLD streamed on after its
    final) are appended and extended; MD's stream continues after them. Disagreeing: None."""
    seq, slot = e.seqs.get(rid), slots.get(rid)
    if seq is None or slot is None or slot.closed or slot.emit_from is None:
        return None
    end, have = start + len(toks), len(seq.generated)
    if seq.generated[start:min(end, have)] != toks[:max(0, min(end, have) - start)]:
        return None
    if end > have and not seq.finish_reason:
        seq.append_known(start, toks)  # known here now: MD computes their KV and emits what follows
        seq.paused = False
        _running(slot)
    return slot.emit_from, list(seq.generated[end:slot.emit_from])


def _snapshot(e, rid):
    """Engine thread (RLD): the tokens generated so far, or None once finished."""
    seq = e.seqs.get(rid)
    return None if seq is None or seq.finish_reason else list(seq.generated)


def _running(slot: Slot) -> None:
    """Engine thread: the slot's sequence was just unpaused by handed tokens: a RESERVED slot is
    HELD (MD decodes ahead, its output held for the final), a HANDING_OFF one DECODING again."""
    if slot.state is SlotState.RESERVED:
        slot.move(SlotState.HELD)
    elif slot.state is SlotState.HANDING_OFF:
        slot.move(SlotState.DECODING)


def _pause(e, rid, slots: SlotTable):
    """Engine thread (RLD): pause for the final handoff (HANDING_OFF); the tokens to hand, or
    None once finished."""
    seq = e.seqs.get(rid)
    if seq is None or seq.finish_reason:
        return None
    seq.paused = True
    slot = slots.get(rid)
    if slot is not None and slot.state is SlotState.DECODING:
        slot.move(SlotState.HANDING_OFF)
    return list(seq.generated)


def _resume(e, rid, slots: SlotTable):
    """Engine thread (RLD): the final handoff failed; decode on here (DECODING)."""
    seq = e.seqs.get(rid)
    if seq is not None:
        seq.paused = False
    slot = slots.get(rid)
    if slot is not None and slot.state is SlotState.HANDING_OFF:
        slot.move(SlotState.DECODING)
