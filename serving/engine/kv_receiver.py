"""The KV import side of the Decode services: PushKV, the chunks P streams into RLD and MD.

Chunks land in the pool as they arrive (P streams them while still prefilling); imports are
coalesced. On the last chunk the known tokens (P's first token) are appended and decoding
starts (RLD; MD in pd-cross); with none, the sequence stays paused for RLD's handoff (MD in pdd).
A chunk for a request that is not reserved here is NOT_FOUND, or ABORTED after a cancel.
KV in a compact wire format (bf16, int8, fp8, +zstd: the header's `kv_wire`) is decoded into
this engine's pool dtype as it arrives (kvwire.Assembler); a format this receiver did not
declare in its Info (`accepts`, ServiceInfo.kv_wire_formats) is INVALID_ARGUMENT.
KV from a sender of another tensor-parallel degree arrives as each shard's head range
(kvwire.Assembler holds a token block until every range of the sender's split is in, refuses
heads missing or twice); the engine's import places each head on the devices of this pool
that hold it (canonical.import_run), whatever this engine's own degree.
Hostile streams: each chunk is checked and decoded in a worker thread (never on the event
loop); its header must state this model's layers, KV heads and head_dim and a token span
within the reservation, before anything is decompressed (kvwire.Assembler); non-finite values
are refused (codec). Any failure of a push (a refusal, an exception, MemoryError) fails the
reservation, its pages freed and nothing of it cached; a push cut off (cancelled, or ended
before its last chunk) leaves it for a replacement P, or PDDJAX_KV_WAIT_SECONDS.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

import grpc

from pddjax.kv.canonical import KVImportError, degree, head_ranges, span
from pddjax.model.sampling_params import MAX_TOP_LOGPROBS
from serving.engine.slot import WAITING
from serving.kvwire import ACCEPTED, Assembler, WireError
from serving.pb import cluster_pb2

# A native chunk (raw copies: no decompression) of at most this many payload bytes is checked and
# decoded on the event loop (tens of microseconds); any other on a worker thread, so a big or
# compressed chunk stalls no other stream. A thread hop per chunk was ~12% of RLD's CPU under
# many short requests (one small chunk each).
ON_LOOP_BYTES = 64 * 1024

if TYPE_CHECKING:
    from serving.engine.slot import SlotTable
    from serving.engine.worker import EngineWorker


class KVReceiver:
    """PushKV of one Decode service: writes the KV of the requests reserved in `slots` into the
    engine's pool through `worker`. `fingerprint` is the model's (a chunk of another model's KV
    is refused), `vocab_size` the model's (known tokens past it are refused); `role` names this
    service in error messages; `accepts` the KV wire formats it decodes (declared in its Info)."""

    def __init__(self, role: str, fingerprint: str, worker: EngineWorker, slots: SlotTable, vocab_size: int,
                 accepts: tuple[str, ...] = ACCEPTED):
        self.role, self.fingerprint, self.worker, self.slots = role, fingerprint, worker, slots
        self.vocab_size, self.accepts = vocab_size, tuple(accepts)
        self.dtype = worker.engine.config.dtype  # lossy formats decode straight into the pool's dtype
        cfg = worker.engine.cfg
        self.model_layout = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)  # what a KV header must say
        pool = worker.engine.pool
        self.layout = f"{degree(pool)} device(s) holding KV heads {_ranges(head_ranges(pool))}"  # this pool's
        self.senders_seen: set[tuple[int, tuple[int, ...]]] = set()  # (degree, head split) of senders logged

    async def push(self, request_iterator, context) -> cluster_pb2.PushKVResponse:
        """Chunks are read as they come and decoded off the event loop (a worker thread); imports
        are coalesced: while one import waits for the engine thread (a step in flight), the
        chunks that arrive meanwhile are imported together by the next call, so a long push
        costs a few engine calls, not one per chunk. Any failure fails the reservation."""
        asm, rid, imported = None, None, 0
        batch: list = []  # KV runs assembled, not yet handed to the engine thread
        pending = None  # the import in flight (a task)

        async def settle(wait: bool) -> None:
            nonlocal pending, batch, imported
            if pending is not None and (wait or pending.done()):
                ok, pending = await pending, None
                if not ok:
                    raise self._gone(rid)  # released while its KV was on the way: dropped
            if pending is None and batch:
                imported += sum(span(r)[1] - span(r)[0] for r in batch)
                pending, batch = asyncio.ensure_future(self.worker.call(self._import_all, rid, batch)), []
                pending.add_done_callback(_observed)  # an error after the stream broke is not "never retrieved"
        try:
            async for chunk in request_iterator:
                if asm is None:  # the first chunk names the stream's request (Assembler refuses another)
                    rid = chunk.request_id
                    asm = self._assembler(rid)
                self.slots.touch(rid)
                if rid not in self.slots:
                    raise self._gone(rid)
                # crc, checks, decompress, decode
                run = asm.feed(chunk) if _on_loop(asm, chunk) else await asyncio.to_thread(asm.feed, chunk)
                if chunk.seq == 0:
                    self._log_sender(asm.header)
                if run is not None:
                    batch.append(run)
                await settle(wait=False)
                if chunk.last:
                    bad = [t for t in chunk.known_tokens if t >= self.vocab_size]
                    if bad:
                        raise WireError("INVALID_ARGUMENT", f"known token {bad[0]} of {rid} is outside the "
                                                            f"vocabulary [0, {self.vocab_size})")
                    problem = logprobs_problem(chunk, self.vocab_size)
                    if problem:
                        raise WireError("INVALID_ARGUMENT", f"{problem} (request {rid})")
                    while pending is not None or batch:  # the import in flight, then the runs queued behind it
                        await settle(wait=True)
                    if not await self.worker.call(self._kv_complete, rid, list(chunk.known_tokens),
                                                  list(chunk.known_logprobs)):
                        raise self._gone(rid)
                    return cluster_pb2.PushKVResponse(tokens_imported=imported, bytes_received=asm.bytes,
                                                      chunks=asm.next_seq)
        except (WireError, KVImportError) as e:
            code = e.code_name if isinstance(e, WireError) else "FAILED_PRECONDITION"
            await self._fail(rid, code, str(e), context)
        except grpc.aio.AbortError:  # the gate refused a malformed chunk mid-stream: the reservation goes too
            await self.fail(rid, grpc.StatusCode.INVALID_ARGUMENT,
                            f"a KV chunk of {rid} is not a valid KVChunk message")
            raise
        except MemoryError:
            await self._fail(rid, "RESOURCE_EXHAUSTED", f"{self.role} ran out of memory decoding the KV of {rid}",
                             context)
        except Exception as e:  # a bug or a payload no check foresaw: the slot must not stay open
            await self._fail(rid, "INTERNAL", f"importing the KV of {rid} on {self.role} failed "
                                              f"({type(e).__name__})", context)
        await context.abort(grpc.StatusCode.DATA_LOSS, f"KV stream for {rid} ended before its last chunk")

    async def fail(self, rid: str, code: grpc.StatusCode, message: str) -> None:
        """Fail `rid`'s reservation (its pages freed, its Decode stream ended with `code`), if open."""
        if rid in self.slots:
            await self.worker.call(self.slots.fail, rid, code, message)

    def _assembler(self, rid: str) -> Assembler:
        """The checks of one stream: this model's layout, and the tokens `rid`'s reservation holds
        (read once, from the loop: a sequence's token count only grows on the engine thread)."""
        seq = self.worker.engine.seqs.get(rid)
        if seq is None:
            raise self._gone(rid)
        return Assembler(self.fingerprint, self.accepts, self.dtype, self.model_layout, seq.num_tokens)

    async def _fail(self, rid, code: str, message: str, context) -> None:
        """The push ends with `code`; the reservation (never decoded) is failed with it, unless
        it is gone already (NOT_FOUND, ABORTED)."""
        if code not in ("NOT_FOUND", "ABORTED"):
            await self.fail(rid, getattr(grpc.StatusCode, code), message)
        await context.abort(getattr(grpc.StatusCode, code), message)

    def _log_sender(self, h: cluster_pb2.KVHeader) -> None:
        """One line per sender layout (degree, head split) this service first receives KV from
        (at most 16: the header is the sender's word)."""
        key = (h.tensor_parallel or 1, tuple(h.head_bounds) or (0, h.num_kv_heads))
        if key not in self.senders_seen and len(self.senders_seen) < 16:
            self.senders_seen.add(key)
            split = list(zip(key[1], key[1][1:]))
            print(f"pddjax {self.role}: KV from a tensor_parallel {key[0]} sender (heads {_ranges(split)} per "
                  f"chunk) placed on {self.layout}", flush=True)

    def _gone(self, rid) -> WireError:
        """A chunk for a request that is not (or no longer) here: late after a cancel, or unknown."""
        if self.slots.was_cancelled(rid):
            return WireError("ABORTED", f"request {rid} was released on {self.role}; its KV is dropped")
        return WireError("NOT_FOUND", f"request {rid} is not reserved on {self.role}")

    def _import_all(self, e, rid, runs) -> bool:
        """Engine thread: write KV pieces (in order; each a run or one token block's head pieces from
        a tensor-parallel sender) if the request is still open here (else drop them)."""
        slot = self.slots.get(rid)
        if slot is None or slot.closed or rid not in e.seqs:
            return False
        for run in runs:
            e.import_kv(rid, run)
        return True

    def _kv_complete(self, e, rid, known, known_logprobs) -> bool:
        """Engine thread: the last chunk landed (the known tokens' logprobs are kept for the stream
        when the request asked for them). False if the request is no longer open here."""
        slot, seq = self.slots.get(rid), e.seqs.get(rid)
        if slot is None or seq is None or slot.closed:
            return False
        if slot.state not in WAITING:
            return True  # a second push, from a P that replaced a failed one, changes nothing
        if known:
            if slot.logprobs is not None:
                slot.logprobs.update(enumerate(known_logprobs))
            seq.append_known(0, known)
            seq.paused = False
            self.slots.decode(slot, 0)
        return True


def logprobs_problem(chunk, vocab_size: int) -> str | None:
    """One sentence on what is wrong with a last chunk's known_logprobs, or None: none, or one
    per known token, each a finite logprob <= 0 with at most 20 alternatives in the vocabulary."""
    lps = chunk.known_logprobs
    if not lps:
        return None
    if len(lps) != len(chunk.known_tokens):
        return f"{len(lps)} known logprobs for {len(chunk.known_tokens)} known tokens"
    for lp in lps:
        if not (math.isfinite(lp.logprob) and lp.logprob <= 0):
            return f"known logprob {lp.logprob} is not a finite number <= 0"
        if len(lp.top_ids) != len(lp.top_logprobs) or len(lp.top_ids) > MAX_TOP_LOGPROBS:
            return f"known logprob has {len(lp.top_ids)} alternative ids and {len(lp.top_logprobs)} logprobs"
        if any(t >= vocab_size for t in lp.top_ids):
            return f"known logprob names a token outside the vocabulary [0, {vocab_size})"
    return None


def _on_loop(asm: Assembler, chunk: cluster_pb2.KVChunk) -> bool:
    """Small and native (the stream's format, or for its first chunk the header's)."""
    if len(chunk.k) + len(chunk.v) + len(chunk.scales) > ON_LOOP_BYTES:
        return False
    name = asm.format.name if asm.format is not None else (chunk.header.kv_wire or "native")
    return name == "native"


def _ranges(ranges) -> str:
    return " ".join(f"[{a}, {b})" for a, b in ranges)


def _observed(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
