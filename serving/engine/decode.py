"""The Decode service, run as RLD (relay) and as MD (main). One engine, one engine thread.

A request's life here:
  Reserve      add() the sequence paused: pins the prefix-cache hit (MD: the DRC prefix) and
               reserves pages for prompt + max_tokens; answers the cached token count.
  PushKV       chunks from P land in the pool as they arrive (P streams them while still
               prefilling); on the last one the known tokens (P's first token) are appended and
               decoding starts (RLD; MD in pd-cross). The KVReceiver (kv_receiver.py);
               PushKVStream carries many requests' (P's one per instance; kv_stream.py).
  Decode       the stream of tokens this tier produces for the user, from `emit_from` on;
               DecodeStream carries many requests' (the router's; decode_stream.py).
  Handoff      (RLD) hand token IDs to MD: one-shot, or chunk by chunk while more than the
               threshold is pending; RLD pauses, MD acknowledges, RLD's stream ends with
               handed_off_at = N and RLD releases the request. The Handoff (handoff.py).
  HandoffTokens (MD) append RLD's tokens and extend-decode them; a non-final chunk is
               acknowledged once MD has caught up on it; on the final one MD emits from N on.
               Applied once per (request, chunk_seq | final): RLD retries a try whose
               connection broke or whose answer was lost, and MD answers a repeat like the first.
               The Handoff (handoff.py).
  Hold         (RLD) pause / resume a decoding request while the router waits for MD (hold.py).
  Release      idempotent; `cache` inserts the computed context into the prefix cache (DRC).
               A cancel leaves a tombstone: a Reserve arriving late for that id is ABORTED.
  Info, MatchPrefix  as on every engine service (info.py).
Leases: a reservation with no open Decode stream and no traffic (PushKV, Handoff*) for
PDDJAX_LEASE_SECONDS is dropped (an aborted transfer or a vanished router never leaks a slot); one
still waiting for its KV with no KV traffic for PDDJAX_KV_WAIT_SECONDS is dropped even with its
stream open (DEADLINE_EXCEEDED on that stream).

Sequences are held on finish (hold_on_finish) so MD's tokens sampled ahead of a chunked
handoff are kept until the final chunk confirms them; tokens that disagree with RLD's (a
heterogeneous pair) are rolled back and recomputed: the user's stream is RLD's up to N.
A request's state is a Slot in the service's SlotTable (slot.py: a SlotState, moved only as
its LEGAL_TRANSITIONS allow); this file holds the service, which owns the table, the KV
receiver, the handoff and the leases (leases.py), and answers Reserve, Decode and Release
itself, with the engine step's hook.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc

from pddjax.kv.allocator import OutOfPages
from pddjax.kv.page_table import pages_needed
from serving import rpc
from serving.engine import calls, decode_stream, hold
from serving.engine.grammars import compile_or_refuse
from serving.engine.handoff import Handoff
from serving.engine.info import match_prefix, service_info
from serving.engine.kv_receiver import KVReceiver
from serving.engine.kv_stream import KVStream
from serving.engine.leases import Leases
from serving.engine.page_queue import REFUSED, PageQueue, refusal_status
from serving.engine.probe import probe
from serving.engine.slot import RpcFailure, Slot, SlotTable
from serving.engine.worker import EngineWorker, resolve
from serving.pb import cluster_pb2, cluster_pb2_grpc, common_pb2

if TYPE_CHECKING:
    from pddjax.engines.paged_engine import PagedEngine
    from pddjax.model.config import ModelConfig

class DecodeService(cluster_pb2_grpc.DecodeServicer):
    """`role` is "relay" (RLD) or "main" (MD); `info` the static ServiceInfo fields;
    `handoff_peers` the MD addresses RLD may hand off to (empty: any; handoff.py)."""

    def __init__(self, role: str, engine: PagedEngine, model_config: ModelConfig, info: dict, handoff_peers=()):
        self.role, self.engine, self.cfg, self.info = role, engine, model_config, info
        self.handoff_peers = tuple(handoff_peers)
        # built by start(): each needs the engine worker, which needs the event loop
        self.worker: EngineWorker | None = None
        self.slots: SlotTable | None = None
        self.kv: KVReceiver | None = None
        self.handoff: Handoff | None = None
        self.pages: PageQueue | None = None
        self._lease_task: asyncio.Task | None = None
        self.persistent: set = set()  # open PushKVStreams (KVStream), DecodeStreams (Sink), Calls (CallStream)
        self.draining = False
        self.metrics = None  # the service's (attach_metrics): calls on Calls streams count there

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.worker = EngineWorker(self.engine, loop, self._on_step, name=f"engine-{self.role}")
        self.slots = SlotTable(self.engine, self.worker)
        self.pages = PageQueue(self.worker, self.role)  # Reserves waiting for pages (wait_for_pages)
        self.kv = KVReceiver(self.role, self.engine.fingerprint, self.worker, self.slots, self.cfg.vocab_size)
        self.handoff = Handoff(self.role, self.worker, self.slots, self.cfg.vocab_size, self.handoff_peers)
        self.worker.faults.on_fault = self._step_failed
        self._lease_task = loop.create_task(Leases(self.role, self.worker, self.slots).run())

    def _on_step(self, events) -> None:
        """Engine thread: a step's tokens to their streams; HandoffTokens waiting for MD to catch up wake."""
        for ev in events:
            slot = self.slots.get(ev.seq_id)
            if slot is None or slot.closed:
                continue
            if slot.emit_from is None or ev.position < slot.emit_from:
                if slot.logprobs is not None and ev.logprobs is not None:  # held: emitted with the rest later
                    slot.logprobs[ev.position] = rpc.logprob_to_pb(ev.logprobs)
                continue
            lp = ev.logprobs if slot.logprobs is not None else None
            if lp is None and not ev.finish_reason:  # the common row: one token, built into its message once
                self.slots.put_token(slot, ev.position, ev.token)
                continue
            batch = cluster_pb2.TokenBatch(start_position=ev.position, token_ids=[ev.token],
                                           finish_reason=rpc.FINISH[ev.finish_reason])
            if lp is not None:
                batch.logprobs.append(rpc.logprob_to_pb(lp))
            if ev.finish_reason:
                self.slots.close(slot, batch)
            else:
                self.slots.put(slot, batch)
        self.pages.on_engine(self.engine)
        for slot in self.slots:
            if slot.waiters:
                seq = self.engine.seqs.get(slot.request_id)
                if seq is None:
                    continue
                done = [w for w in slot.waiters if seq.pages.num_tokens >= w[0] or seq.finish_reason]
                for w in done:
                    slot.waiters.remove(w)
                    self.worker.post(resolve, w[1], seq.pages.num_tokens - len(seq.prompt))

    def _step_failed(self, e, rids: list[str], sentence: str) -> None:
        """Engine thread: a step of these requests raised; their streams end INTERNAL."""
        for rid in rids:
            slot = self.slots.get(rid)
            if slot is not None:
                self.slots.close(slot, RpcFailure(grpc.StatusCode.INTERNAL, f"{sentence}; request {rid} ended"),
                                 cache=False)

    # ---- RPCs -------------------------------------------------------------------------
    async def Reserve(self, request, context):
        rid, prompt, params, max_tokens, stop_ids = rpc.spec_from_pb(request.spec)
        err = rpc.validate_spec(self.cfg, rid, prompt, params, max_tokens)
        if err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        never = self.engine.never_fits(len(prompt), max_tokens)  # before it could queue for pages
        if never:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, never)
        if rid in self.slots:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already reserved here")
        if self.slots.was_cancelled(rid):
            await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was cancelled on {self.role}")
        await compile_or_refuse(self.engine, params, context)
        slot = Slot(rid, asyncio.Queue(), logprobs={} if params.logprobs else None)

        def reserve(e):
            if self.slots.was_cancelled(rid):  # a cancel overtook this Reserve: never leave an orphan slot
                return None
            seq = e.add(rid, prompt, params, max_tokens, stop_ids, hold_on_finish=True, use_cache=request.use_cache)
            seq.paused = True
            self.slots.add(slot)
            return seq.pages.num_cached

        queued = 0.0
        try:
            if request.wait_for_pages:  # a full pool: wait in the FIFO for pages (page_queue.py)
                need = pages_needed(len(prompt) + max_tokens, self.engine.config.page_size)
                cached, queued = await self.pages.admit(reserve, need, rpc.time_left(context))
            else:
                cached = await self.worker.call(reserve)
            if cached is None:
                await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was cancelled on {self.role}")
        except OutOfPages:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the {self.role} pool cannot hold {len(prompt)} + {max_tokens} tokens now")
        except REFUSED as e:  # a full queue, the deadline, a request that can never fit
            await context.abort(refusal_status(e), str(e))
        return cluster_pb2.ReserveResponse(cached_tokens=cached, queued_ms=1e3 * queued)

    async def PushKV(self, request_iterator, context):
        return await self.kv.push(request_iterator, context)

    async def PushKVStream(self, request_iterator, context):
        """Many requests' PushKV on one (kv_stream.py): P's per decode instance."""
        kvs = KVStream(self.kv)
        async for res in self._persistent(kvs, kvs.serve(request_iterator)):
            yield res

    async def Decode(self, request, context):
        slot = self.slots.get(request.request_id)
        if slot is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request {request.request_id} is not reserved on {self.role}")
        if slot.streams:  # one reader per slot: a second would wait forever for what the first takes
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request {request.request_id} already has an open Decode stream on {self.role}")
        slot.streams += 1
        try:
            held = None  # an item taken while merging that belongs to the next message
            while True:
                item, held = _merge_ready(held if held is not None else await slot.out.get(), slot.out)
                if isinstance(item, RpcFailure):
                    await context.abort(item.code, item.message)
                yield item
                if item.finish_reason or item.handed_off:
                    return
        finally:
            slot.streams -= 1
            slot.touched = time.monotonic()

    async def DecodeStream(self, request_iterator, context):
        """Many requests' Decode streams on one (decode_stream.py): the router's per instance."""
        sink = decode_stream.Sink(self.slots, self.role, self.metrics.stream_entries if self.metrics else None)
        async for msg in self._persistent(sink, decode_stream.serve(sink, request_iterator)):
            yield msg

    def attach_metrics(self, metrics) -> None:
        """The service's metrics (serving/stack/server.py): calls on Calls streams count there by method."""
        self.metrics = metrics

    async def Calls(self, request_iterator, context):
        """Unary calls as messages of one stream (calls.py): the router's per instance, RLD's per MD."""
        stream = calls.CallStream(self, self.role, context, self.metrics)
        async for msg in self._persistent(stream, stream.serve(request_iterator)):
            yield msg

    async def _persistent(self, stream, responses):
        """`responses` of a stream its caller keeps open across requests (`stream`: its state, with
        `drain()`): while the service drains, it ends as soon as nothing of it is in flight (the
        drain waits for in-flight RPCs, not idle streams)."""
        self.persistent.add(stream)
        if self.draining:
            stream.drain()
        try:
            async for msg in responses:
                yield msg
        finally:
            self.persistent.discard(stream)

    def drain(self) -> None:
        """SIGTERM (serving/stack/server.py): the persistent streams end once idle."""
        self.draining = True
        for stream in list(self.persistent):
            stream.drain()

    async def Handoff(self, request, context):
        return await self.handoff.handoff(request, context)

    async def HandoffTokens(self, request, context):
        return await self.handoff.handoff_tokens(request, context)

    async def Hold(self, request, context):
        return await hold.serve(self.worker, self.slots, request)

    async def Release(self, request, context):
        if request.cancel and request.request_id:
            self.slots.tombstone(request.request_id)

        def release(e):
            slot = self.slots.get(request.request_id)
            if slot is not None:
                item = cluster_pb2.TokenBatch(finish_reason=common_pb2.FINISH_REASON_CANCELLED)
                self.slots.close(slot, item, cache=request.cache)
                return True
            if request.request_id in e.seqs:
                e.release(request.request_id, cache=request.cache)
                return True
            return False

        def release_and_wake(e):
            found = release(e)
            self.pages.on_engine(e)  # pages freed: the first request waiting for pages tries
            return found

        return cluster_pb2.ReleaseResponse(found=await self.worker.call(release_and_wake))

    async def Info(self, request, context):
        info = await service_info(self.worker, self.info, check=self.slots.check_integrity)
        info.integrity_error = info.integrity_error or decode_stream.integrity_error(self.persistent)
        return info

    async def MatchPrefix(self, request, context):
        return await match_prefix(self.worker, self.engine.config.page_size, request, context)

    async def Probe(self, request, context):
        return await probe(request, context)


def _merge_ready(item, out: asyncio.Queue):
    """One stream message for every token that is ready: TokenBatches queued behind `item` (a
    writer slower than the engine) join it while they continue it -> (message, the item that
    ended the merge or None). A failure, a finish or a handoff is never merged into."""
    if not isinstance(item, cluster_pb2.TokenBatch) or item.finish_reason or item.handed_off:
        return item, None
    while not out.empty():
        nxt = out.get_nowait()
        if (not isinstance(nxt, cluster_pb2.TokenBatch) or nxt.handed_off
                or nxt.start_position != item.start_position + len(item.token_ids)):
            return item, nxt
        item.token_ids.extend(nxt.token_ids)
        item.logprobs.extend(nxt.logprobs)
        if nxt.finish_reason:
            item.finish_reason = nxt.finish_reason
            break
    return item, None
