"""The Decode service, run as RLD (relay) and as MD (main). One engine, one engine thread.

A request's life here:
  Reserve      add() the sequence paused: pins the prefix-cache hit (MD: the DRC prefix) and
               reserves pages for prompt + max_tokens; answers the cached token count.
  PushKV       chunks from P land in the pool as they arrive (P streams them while still
               prefilling); on the last one the known tokens (P's first token) are appended and decoding starts (RLD; MD in pd-cross).
  Decode       the stream of tokens this tier produces for the user, from `emit_from` on.
  Handoff      (RLD) hand token IDs to MD: one-shot, or chunk by chunk while more than the
               threshold is pending; RLD pauses, MD acknowledges, RLD's stream ends with
               handed_off_at = N and RLD releases the request.
  HandoffTokens (MD) append RLD's tokens and extend-decode them; a non-final chunk is
               acknowledged once MD has caught up on it; on the final one MD emits from N on.
               Applied once per (request, chunk_seq | final): RLD retries a try whose
               connection broke or whose answer was lost, and MD answers a repeat like the first.
  Release      idempotent; `cache` inserts the computed context into the prefix cache (DRC).
               A cancel leaves a tombstone: a Reserve arriving late for that id is ABORTED.
Leases: a reservation with no open Decode stream and no traffic (PushKV, Handoff*) for
LEASE_SECONDS is dropped (an aborted transfer or a vanished router never leaks a slot).

Sequences are held on finish (hold_on_finish) so MD's tokens sampled ahead of a chunked
handoff are kept until the final chunk confirms them; tokens that disagree with RLD's (a
heterogeneous pair) are rolled back and recomputed: the user's stream is RLD's up to N.
"""

from __future__ import annotations

import array
import asyncio
import collections
import dataclasses
import os
import sys
import time
import zlib

import grpc

from pddjax.kv.allocator import OutOfPages
from pddjax.kv.canonical import KVImportError
from pddjax.serving import rpc
from pddjax.serving.engine_rpcs import EngineRpcs
from pddjax.serving.kvwire import Assembler, WireError
from pddjax.serving.pb import cluster_pb2, cluster_pb2_grpc, common_pb2
from pddjax.serving.pools import CHANNEL_OPTIONS as PEER_CHANNEL_OPTIONS
from pddjax.serving.worker import EngineWorker


@dataclasses.dataclass
class Slot:
    request_id: str
    out: asyncio.Queue  # TokenBatch | Exception, read by the Decode stream
    emit_from: int | None = None  # output positions >= this go to the user (engine thread)
    waiters: list = dataclasses.field(default_factory=list)  # (kv tokens needed, asyncio.Future)
    closed: bool = False
    decoding: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # KV landed, tokens flow
    touched: float = dataclasses.field(default_factory=time.monotonic)  # last RPC about it (lease)
    streams: int = 0  # open Decode streams (a stream keeps the lease)
    born: float = dataclasses.field(default_factory=time.monotonic)
    reported: bool = False  # logged once when it outlives LINGER_LEASES leases (diagnostics)


LEASE_SECONDS = float(os.environ.get("PDDJAX_LEASE_SECONDS", "60"))
HANDOFF_TIMEOUT_SECONDS = float(os.environ.get("PDDJAX_HANDOFF_TIMEOUT_SECONDS", "10"))  # per HandoffTokens try
HANDOFF_RETRY_WAITS = (0.2, 0.5, 1.0)  # before each retry of the same chunk (MD applies it once)
LINGER_LEASES = 3  # a slot alive this many leases is logged once with its state
TOMBSTONES = 10000  # cancelled request ids remembered (a late Reserve for one is refused)
HANDOFFS_REMEMBERED = 10000  # MD: applied handoff chunks (a retry is answered, never applied twice)


class DecodeService(EngineRpcs, cluster_pb2_grpc.DecodeServicer):
    def __init__(self, role: str, engine, model_config, info: dict):
        self.role, self.engine, self.cfg, self.info = role, engine, model_config, info
        self.slots: dict[str, Slot] = {}
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.worker: EngineWorker | None = None
        self.cancelled: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.leases_expired = 0
        # MD: (request, chunk_seq | "final") -> ((start, tokens' crc), ack future); outlives the slot, so a
        # retry whose answer was lost is answered even after the request finished here
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
                    failure = _RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED,
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
            self.worker.post(_resolve, fut, -1)
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
                    self.worker.post(_resolve, w[1], seq.pages.num_tokens - len(seq.prompt))

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

    async def PushKV(self, request_iterator, context):
        """Chunks are read as they come; imports are coalesced: while one import waits for the
        engine thread (a step in flight), the chunks that arrive meanwhile are imported together
        by the next call, so a long push costs a few engine calls, not one per chunk."""
        asm, rid, imported = Assembler(self.engine.fingerprint), None, 0
        batch: list = []  # KV runs assembled, not yet handed to the engine thread
        pending = None  # the import in flight (a task)

        async def settle(wait: bool) -> None:
            nonlocal pending, batch, imported
            if pending is not None and (wait or pending.done()):
                ok, pending = await pending, None
                if not ok:
                    raise self._gone(rid)  # released while its KV was on the way: dropped
            if pending is None and batch:
                imported += sum(r.num_tokens for r in batch)
                pending, batch = asyncio.ensure_future(self.worker.call(self._import_all, rid, batch)), []
                pending.add_done_callback(_observed)  # an error after the stream broke is not "never retrieved"
        try:
            async for chunk in request_iterator:
                rid = rid or chunk.request_id
                self._touch(rid)
                if rid not in self.slots:
                    raise self._gone(rid)
                run = asm.feed(chunk)
                if run is not None:
                    batch.append(run)
                await settle(wait=False)
                if chunk.last:
                    await settle(wait=True)
                    await settle(wait=True)  # the runs that queued behind the last import
                    if not await self.worker.call(self._kv_complete, rid, list(chunk.known_tokens)):
                        raise self._gone(rid)
                    return cluster_pb2.PushKVResponse(tokens_imported=imported, bytes_received=asm.bytes, chunks=asm.next_seq)
        except (WireError, KVImportError) as e:
            code = e.code_name if isinstance(e, WireError) else "FAILED_PRECONDITION"
            if rid in self.slots and code not in ("NOT_FOUND", "ABORTED"):  # never decoded: drop it
                await self.worker.call(self._fail, rid, getattr(grpc.StatusCode, code), str(e))
            await context.abort(getattr(grpc.StatusCode, code), str(e))
        await context.abort(grpc.StatusCode.DATA_LOSS, f"KV stream for {rid} ended before its last chunk")

    def _gone(self, rid) -> WireError:
        """A chunk for a request that is not (or no longer) here: late after a cancel, or unknown."""
        if rid in self.cancelled:
            return WireError("ABORTED", f"request {rid} was released on {self.role}; its KV is dropped")
        return WireError("NOT_FOUND", f"request {rid} is not reserved on {self.role}")

    def _import_all(self, e, rid, runs) -> bool:
        """Engine thread: write KV pieces (in order) if the request is still open here (else drop them)."""
        slot = self.slots.get(rid)
        if slot is None or slot.closed or rid not in e.seqs:
            return False
        for run in runs:
            e.import_kv(rid, run)
        return True

    def _fail(self, e, rid, code, message):
        slot = self.slots.get(rid)
        if slot is not None:
            self._close(slot, _RpcFailure(code, message), cache=False)

    def _kv_complete(self, e, rid, known) -> bool:
        """Engine thread: the last chunk landed. False if the request is no longer open here."""
        slot, seq = self.slots.get(rid), e.seqs.get(rid)
        if slot is None or seq is None or slot.closed:
            return False
        if slot.emit_from is not None:
            return True  # a second push, from a P that replaced a failed one, changes nothing
        if known:
            seq.append_known(0, known)
            seq.paused = False
            slot.emit_from = 0
            self.worker.post(slot.decoding.set)
            self._emit_held(slot)
        return True

    async def Decode(self, request, context):
        slot = self.slots.get(request.request_id)
        if slot is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request {request.request_id} is not reserved on {self.role}")
        slot.streams += 1
        try:
            while True:
                item = await slot.out.get()
                if isinstance(item, _RpcFailure):
                    await context.abort(item.code, item.message)
                yield item
                if item.finish_reason or item.handed_off:
                    return
        finally:
            slot.streams -= 1
            slot.touched = time.monotonic()

    async def Handoff(self, request, context):
        """RLD: hand the request's token IDs to MD (one-shot or chunked), then stop."""
        rid = request.request_id
        self._touch(rid)
        slot = self.slots.get(rid)
        if slot is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request {rid} is not on {self.role}")
        # MD may hold its KV before RLD does (a large DRC hit): hand off only once RLD decodes
        await slot.decoding.wait()
        ch = self.channels.get(request.main_address) or rpc.channel(request.main_address, PEER_CHANNEL_OPTIONS)
        self.channels[request.main_address] = ch
        md = cluster_pb2_grpc.DecodeStub(ch)
        chunked = request.mode == common_pb2.HANDOFF_MODE_CHUNKED
        threshold = request.threshold or 64
        sent, chunks = 0, 0
        while True:
            toks = await self.worker.call(_snapshot, rid)
            if toks is None:  # RLD finished first
                return cluster_pb2.HandoffResponse(handed_off=False, chunks=chunks, tokens=sent)
            if chunked and len(toks) - sent > threshold:
                await self._send_tokens(md, cluster_pb2.HandoffTokensRequest(
                    request_id=rid, start_position=sent, token_ids=toks[sent:], final=False, chunk_seq=chunks))
                sent, chunks = len(toks), chunks + 1
                continue
            toks = await self.worker.call(_pause, rid)
            if toks is None:
                return cluster_pb2.HandoffResponse(handed_off=False, chunks=chunks, tokens=sent)
            try:
                await self._send_tokens(md, cluster_pb2.HandoffTokensRequest(
                    request_id=rid, start_position=sent, token_ids=toks[sent:], final=True, chunk_seq=chunks))
            except BaseException:
                self.worker.run_soon(_resume, rid)  # MD failed (or we were cancelled): RLD finishes the request
                raise
            await self.worker.call(self._handed_off, rid, len(toks))
            return cluster_pb2.HandoffResponse(handed_off=True, handed_off_at=len(toks), chunks=chunks + 1, tokens=len(toks))

    async def _send_tokens(self, md, req) -> None:
        """RLD: one HandoffTokens, retried when the connection breaks or the answer is lost
        (UNAVAILABLE, DEADLINE_EXCEEDED): MD keys it by (request, chunk_seq | final) and applies
        it once, answering a retry with the first attempt's acknowledgement."""
        for wait in (*HANDOFF_RETRY_WAITS, None):
            try:
                await md.HandoffTokens(req, timeout=HANDOFF_TIMEOUT_SECONDS)
                return
            except grpc.aio.AioRpcError as e:
                if wait is None or e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                print(f"{self.role}: handoff {req.request_id} chunk {req.chunk_seq} (final={req.final}) failed "
                      f"({e.code().name}); retrying in {wait} s", file=sys.stderr, flush=True)
                await asyncio.sleep(wait)

    def _handed_off(self, e, rid, n):
        slot = self.slots.get(rid)
        if slot is not None:
            self._close(slot, cluster_pb2.TokenBatch(start_position=n, handed_off=True, handed_off_at=n))

    async def HandoffTokens(self, request, context):
        """MD: append RLD's token IDs (extend-decode them); ack a chunk once caught up."""
        rid = request.request_id
        self._touch(rid)
        key = (rid, "final" if request.final else request.chunk_seq)
        sig = (request.start_position, len(request.token_ids), zlib.crc32(array.array("I", request.token_ids)))
        if key in self.handoffs:  # a retry whose answer was lost, or a duplicate: applied once only
            first, prev = self.handoffs[key]
            if first != sig:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"handoff {key[1]} of {rid} was already applied with other tokens")
            caught = await asyncio.shield(prev)
            if isinstance(caught, _RpcFailure):
                await context.abort(caught.code, caught.message)
            return cluster_pb2.HandoffTokensResponse(caught_up_to=max(caught, 0))
        if rid not in self.slots:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request {rid} is not on {self.role}")
        fut = asyncio.get_running_loop().create_future()
        self.handoffs[key] = (sig, fut)
        while len(self.handoffs) > HANDOFFS_REMEMBERED:
            self.handoffs.popitem(last=False)

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
            end = start + len(toks)
            if request.final:
                slot.emit_from = end
                self._emit_held(slot)
                fut.get_loop().call_soon_threadsafe(_resolve, fut, min(seq.pages.num_tokens - len(seq.prompt), end))
            elif seq.pages.num_tokens >= len(seq.prompt) + end or seq.finish_reason:
                fut.get_loop().call_soon_threadsafe(_resolve, fut, end)
            else:
                slot.waiters.append((len(seq.prompt) + end, fut))

        try:
            await self.worker.call(apply)
        except (KeyError, ValueError) as e:
            failure = (_RpcFailure(grpc.StatusCode.NOT_FOUND, f"request {rid} is no longer on {self.role}")
                       if isinstance(e, KeyError) else _RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
            self.handoffs.pop(key, None)
            _resolve(fut, failure)  # a duplicate waiting on this attempt fails alike
            await context.abort(failure.code, failure.message)
        caught = await fut
        return cluster_pb2.HandoffTokensResponse(caught_up_to=max(caught, 0))

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


@dataclasses.dataclass
class _RpcFailure:
    code: grpc.StatusCode
    message: str


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _snapshot(e, rid):
    seq = e.seqs.get(rid)
    return None if seq is None or seq.finish_reason else list(seq.generated)


def _pause(e, rid):
    seq = e.seqs.get(rid)
    if seq is None or seq.finish_reason:
        return None
    seq.paused = True
    return list(seq.generated)


def _resume(e, rid):
    seq = e.seqs.get(rid)
    if seq is not None:
        seq.paused = False


def _observed(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
