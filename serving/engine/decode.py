"""The Decode service, run as RLD (relay) and as MD (main). One engine, one engine thread.

A request's life here:
  Reserve      add() the sequence paused: pins the prefix-cache hit (MD: the DRC prefix) and
               reserves pages for prompt + max_tokens; answers the cached token count.
  PushKV       chunks from P land in the pool as they arrive (P streams them while still
               prefilling); on the last one the known tokens (P's first token) are appended and
               decoding starts (RLD; MD in pd-cross). In decode_kv.py (DecodeKV).
  Decode       the stream of tokens this tier produces for the user, from `emit_from` on.
  Handoff      (RLD) hand token IDs to MD: one-shot, or chunk by chunk while more than the
               threshold is pending; RLD pauses, MD acknowledges, RLD's stream ends with
               handed_off_at = N and RLD releases the request. In decode_handoff.py.
  HandoffTokens (MD) append RLD's tokens and extend-decode them; a non-final chunk is
               acknowledged once MD has caught up on it; on the final one MD emits from N on.
               Applied once per (request, chunk_seq | final): RLD retries a try whose
               connection broke or whose answer was lost, and MD answers a repeat like the first.
               In decode_handoff.py (DecodeHandoff).
  Release      idempotent; `cache` inserts the computed context into the prefix cache (DRC).
               A cancel leaves a tombstone: a Reserve arriving late for that id is ABORTED.
Leases: a reservation with no open Decode stream and no traffic (PushKV, Handoff*) for
LEASE_SECONDS is dropped (an aborted transfer or a vanished router never leaks a slot).

Sequences are held on finish (hold_on_finish) so MD's tokens sampled ahead of a chunked
handoff are kept until the final chunk confirms them; tokens that disagree with RLD's (a
heterogeneous pair) are rolled back and recomputed: the user's stream is RLD's up to N.
A request's state is a Slot (decode_slot.py); this file holds the slots, leases, the
engine-thread helpers the mixins share (_touch, _close, _emit_held, _fail), Reserve, Decode
and Release.
"""

from __future__ import annotations

import asyncio
import collections
import os
import sys
import time

import grpc

from pddjax.kv.allocator import OutOfPages
from serving import rpc
from serving.engine.handoff import DecodeHandoff
from serving.engine.info import EngineRpcs
from serving.engine.kv_receiver import DecodeKV
from serving.engine.slot import RpcFailure, Slot, resolve
from serving.engine.worker import EngineWorker
from serving.pb import cluster_pb2, cluster_pb2_grpc, common_pb2

LEASE_SECONDS = float(os.environ.get("PDDJAX_LEASE_SECONDS", "60"))
LINGER_LEASES = 3  # a slot alive this many leases is logged once with its state
TOMBSTONES = 10000  # cancelled request ids remembered (a late Reserve for one is refused)


class DecodeService(DecodeHandoff, DecodeKV, EngineRpcs, cluster_pb2_grpc.DecodeServicer):
    def __init__(self, role: str, engine, model_config, info: dict):
        self.role, self.engine, self.cfg, self.info = role, engine, model_config, info
        self.slots: dict[str, Slot] = {}
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.worker: EngineWorker | None = None
        self.cancelled: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.leases_expired = 0
        # MD (decode_handoff.py): (request, chunk_seq | "final") -> ((start, n, tokens' crc), ack future);
        # outlives the slot, so a retry whose answer was lost is answered even after the request finished here
        self.handoffs: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()

    def start(self, loop) -> None:
        self.worker = EngineWorker(self.engine, loop, self._on_step, name=f"engine-{self.role}")
        self._lease_task = loop.create_task(self._expire_leases())

    def _touch(self, rid: str) -> None:
        slot = self.slots.get(rid)
        if slot is not None:
            slot.touched = time.monotonic()

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, LEASE_SECONDS / 4))
            now = time.monotonic()
            for slot in list(self.slots.values()):
                if not slot.closed and slot.streams == 0 and now - slot.touched > LEASE_SECONDS:
                    self.leases_expired += 1
                    failure = RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED,
                                         f"the reservation of {slot.request_id} on {self.role} expired "
                                         f"after {LEASE_SECONDS:.0f} s without traffic")
                    await self.worker.call(lambda e, s=slot, f=failure: self._close(s, f, cache=False))
                elif not slot.closed and not slot.reported and now - slot.born > LINGER_LEASES * LEASE_SECONDS:
                    slot.reported = True  # legitimate for a long generation; a leak shows up here first
                    print(f"{self.role}: {slot.request_id} alive {now - slot.born:.0f} s "
                          f"({await self.worker.call(self._describe, slot)})", file=sys.stderr, flush=True)

    def _describe(self, e, slot: Slot) -> str:
        """Engine thread: one line of a slot's state (diagnostics of a request that lingers)."""
        seq = e.seqs.get(slot.request_id)
        state = "no sequence" if seq is None else (
            f"paused={seq.paused} kv={seq.pages.num_tokens}/{len(seq.prompt)} generated={len(seq.generated)} "
            f"pending={seq.num_pending} finish={seq.finish_reason}")
        return (f"streams={slot.streams} emit_from={slot.emit_from} decoding={slot.decoding.is_set()} "
                f"idle {time.monotonic() - slot.touched:.0f} s; {state}")

    # ---- engine-thread helpers ----------------------------------------------------------
    def _put(self, slot: Slot, item) -> None:
        self.worker.post(slot.out.put_nowait, item)

    def _close(self, slot: Slot, item, cache: bool = True) -> None:
        """Engine thread: last message of the stream, drop the sequence."""
        if slot.closed:
            return
        slot.closed = True
        self._put(slot, item)
        if slot.request_id in self.engine.seqs:
            self.engine.release(slot.request_id, cache=cache)
        self.worker.post(slot.decoding.set)  # a pending Handoff wakes up and finds it gone
        for _, fut in slot.waiters:
            self.worker.post(resolve, fut, -1)
        slot.waiters.clear()
        self.worker.post(self.slots.pop, slot.request_id, None)

    def _emit_held(self, slot: Slot) -> None:
        """Engine thread: emit everything generated from emit_from on; close if finished."""
        seq = self.engine.seqs[slot.request_id]
        toks = seq.generated[slot.emit_from:]
        finish = seq.finish_reason
        if toks or finish:
            batch = cluster_pb2.TokenBatch(start_position=slot.emit_from, token_ids=toks, finish_reason=rpc.FINISH[finish])
            if finish:
                self._close(slot, batch)
            else:
                self._put(slot, batch)

    def _on_step(self, events) -> None:
        for ev in events:
            slot = self.slots.get(ev.seq_id)
            if slot is None or slot.closed or slot.emit_from is None or ev.position < slot.emit_from:
                continue
            batch = cluster_pb2.TokenBatch(start_position=ev.position, token_ids=[ev.token],
                                           finish_reason=rpc.FINISH[ev.finish_reason])
            if ev.finish_reason:
                self._close(slot, batch)
            else:
                self._put(slot, batch)
        for slot in list(self.slots.values()):
            if slot.waiters:
                seq = self.engine.seqs.get(slot.request_id)
                if seq is None:
                    continue
                done = [w for w in slot.waiters if seq.pages.num_tokens >= w[0] or seq.finish_reason]
                for w in done:
                    slot.waiters.remove(w)
                    self.worker.post(resolve, w[1], seq.pages.num_tokens - len(seq.prompt))

    # ---- RPCs -------------------------------------------------------------------------
    async def Reserve(self, request, context):
        rid, prompt, params, max_tokens, stop_ids = rpc.spec_from_pb(request.spec)
        err = rpc.validate_spec(self.cfg, rid, prompt, params, max_tokens)
        if err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        if rid in self.slots:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already reserved here")
        if rid in self.cancelled:
            await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was cancelled on {self.role}")
        slot = Slot(rid, asyncio.Queue())

        def reserve(e):
            if rid in self.cancelled:  # a cancel overtook this Reserve: never leave an orphan slot
                return None
            seq = e.add(rid, prompt, params, max_tokens, stop_ids, hold_on_finish=True, use_cache=request.use_cache)
            seq.paused = True
            self.slots[rid] = slot
            return seq.pages.num_cached

        try:
            cached = await self.worker.call(reserve)
            if cached is None:
                await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was cancelled on {self.role}")
        except OutOfPages:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the {self.role} pool cannot hold {len(prompt)} + {max_tokens} tokens now")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return cluster_pb2.ReserveResponse(cached_tokens=cached)

    def _fail(self, e, rid, code, message):
        """Engine thread: end the request's stream with this status (a KV push that broke)."""
        slot = self.slots.get(rid)
        if slot is not None:
            self._close(slot, RpcFailure(code, message), cache=False)

    async def Decode(self, request, context):
        slot = self.slots.get(request.request_id)
        if slot is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request {request.request_id} is not reserved on {self.role}")
        slot.streams += 1
        try:
            while True:
                item = await slot.out.get()
                if isinstance(item, RpcFailure):
                    await context.abort(item.code, item.message)
                yield item
                if item.finish_reason or item.handed_off:
                    return
        finally:
            slot.streams -= 1
            slot.touched = time.monotonic()

    async def Release(self, request, context):
        if request.cancel and request.request_id:
            self.cancelled[request.request_id] = time.monotonic()
            while len(self.cancelled) > TOMBSTONES:
                self.cancelled.popitem(last=False)

        def release(e):
            slot = self.slots.get(request.request_id)
            if slot is not None:
                item = cluster_pb2.TokenBatch(finish_reason=common_pb2.FINISH_REASON_CANCELLED)
                self._close(slot, item, cache=request.cache)
                return True
            if request.request_id in e.seqs:
                e.release(request.request_id, cache=request.cache)
                return True
            return False

        return cluster_pb2.ReleaseResponse(found=await self.worker.call(release))
