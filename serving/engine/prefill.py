"""The Prefill service (P). One engine, one engine thread; concurrent prompts are batched by
the engine's packed step.

Prefill(spec, targets): add() with max_tokens=1 (own prefix cache). After every engine step
the prompt tokens computed so far are exported in the canonical form and streamed to every
target at once (dual path: all of it to RLD, only MD's missing suffix to MD), so the transfer
overlaps the (chunked) prefill; the step that samples the first token exports the rest, the
first token rides on the last chunk, and P's prefix cache gets the prompt at once. The
response stream reports `prefilled` and one `transfer_done` per target (with its error code).
Each target's KV is encoded in the wire format the router chose for it (`KVTarget.kv_wire`:
native, bf16, int8, fp8, +zstd; pddjax.kv.codec) as its chunks are cut, off the event loop;
`transfer_done.bytes` counts the encoded bytes, `native_bytes` the canonical ones. Each push
(one request to one target) is a KVPusher's (kv_push.py).

KV lease: P holds a finished prefill's pages for its targets until each acknowledges the
import (its push is answered after the last chunk landed) or fails, or PDDJAX_KV_LEASE_SECONDS
pass after the prefill: then P frees them and cancels what is
left (DEADLINE_EXCEEDED). A cancel or Release frees at once; a late acknowledgement finds no
call to answer, a late Release finds nothing (found=False).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING

import grpc

from pddjax import env
from pddjax.kv.page_table import pages_needed
from serving import authz, kvwire, rpc
from serving.engine.grammars import compile_or_refuse
from serving.engine.info import match_prefix, service_info
from serving.engine.kv_push import KVPusher
from serving.engine.page_queue import REFUSED, PageQueue, refusal_status
from serving.engine.worker import EngineWorker, fail, resolve
from serving.pb import cluster_pb2, cluster_pb2_grpc

if TYPE_CHECKING:
    from pddjax.engines.paged_engine import PagedEngine
    from pddjax.model.config import ModelConfig


class PrefillService(cluster_pb2_grpc.PrefillServicer):
    """`info` holds the static ServiceInfo fields; `kv_peers` where it may push KV (default:
    loopback addresses only)."""

    def __init__(self, engine: PagedEngine, model_config: ModelConfig, info: dict,
                 kv_peers: authz.KVPeers | None = None):
        self.engine, self.cfg, self.info = engine, model_config, info
        self.kv_peers = kv_peers or authz.KVPeers()
        self.progress: dict[str, _Progress] = {}  # requests still prefilling (engine thread)
        self.pushes: dict[str, list[asyncio.Task]] = {}
        self.pusher: KVPusher | None = None  # the KV pushes to the targets (kv_push.py)
        self.worker: EngineWorker | None = None
        self.pages: PageQueue | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.worker = EngineWorker(self.engine, loop, self._on_step, name="engine-prefill")
        self.pages = PageQueue(self.worker, "prefill")  # prompts waiting for pages
        self.worker.faults.on_fault = self._step_failed
        self.pusher = KVPusher(self.engine.config.page_size, self.engine.config.tensor_parallel)

    async def Prefill(self, request, context):
        rid, prompt, params, max_tokens, stop_ids = rpc.spec_from_pb(request.spec)
        err = rpc.validate_spec(self.cfg, rid, prompt, params, max_tokens)
        if err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        for t in request.targets:
            if t.start > len(prompt):  # its TransferDone would count negative tokens (UNKNOWN before)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"a KV target starts at token {t.start}, "
                                                                      f"past the prompt's {len(prompt)}")
            if (t.kv_wire or "native") not in kvwire.ACCEPTED:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"KV wire format {t.kv_wire!r} for {t.address} is not one of "
                                    f"{', '.join(kvwire.ACCEPTED)}")
        not_peer = self.kv_peers.refusal(t.address for t in request.targets)  # P dials no other address
        if not_peer:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, not_peer)
        never = self.engine.never_fits(len(prompt), 1)  # before it could queue for pages
        if never:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, never)
        await compile_or_refuse(self.engine, params, context)  # P samples the first token: constrained too
        if rid in self.progress or rid in self.pushes:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already on prefill")
        targets, n = list(request.targets), len(prompt)
        start0 = min(min((t.start for t in targets), default=n), n - 1)
        st = _Progress(n, start0, [asyncio.Queue() for _ in targets], asyncio.get_running_loop().create_future())
        self.progress[rid] = st
        t0 = time.perf_counter()

        def admit(e):
            seq = e.add(rid, prompt, params, 1, stop_ids, hold_on_finish=True)
            self._export(e, rid, st, None, None)  # the part P's prefix cache already holds goes out at once
            return seq.pages.num_cached

        chunk_bytes = request.chunk_bytes or rpc.DEFAULT_CHUNK_BYTES
        tasks: list[asyncio.Task] = []
        try:
            try:  # a full pool: the prompt waits in the FIFO for pages (page_queue.py)
                cached, queued = await self.pages.admit(admit, pages_needed(n + 1, self.engine.config.page_size),
                                                        rpc.time_left(context))
            except REFUSED as e:  # a full queue, the deadline, a prompt that can never fit
                await context.abort(refusal_status(e), str(e))
            t0 = time.perf_counter()  # prefill_ms from admission on (queued_ms before it)
            tasks = [asyncio.create_task(self.pusher.push(rid, t, q, max(t.start, start0), n, chunk_bytes))
                     for t, q in zip(targets, st.queues)]
            self.pushes[rid] = tasks
            try:
                first, first_lp = await st.first
            except _Released as e:
                await context.abort(grpc.StatusCode.ABORTED, str(e))
            except _StepFailed as e:
                await context.abort(grpc.StatusCode.INTERNAL, str(e))
            yield cluster_pb2.PrefillEvent(prefilled=cluster_pb2.Prefilled(
                first_token=first, num_cached=cached, prefill_ms=1e3 * (time.perf_counter() - t0),
                queued_ms=1e3 * queued, first_logprob=first_lp))
            # P's KV lease: the pages stay held until every target acknowledged its import (its
            # PushKV answered), failed, or PDDJAX_KV_LEASE_SECONDS passed since the prefill finished
            loop = asyncio.get_running_loop()
            lease_end, pending = loop.time() + env.KV_LEASE_SECONDS.get(), dict(zip(tasks, targets))
            while pending:
                done, _ = await asyncio.wait(pending, timeout=max(0.0, lease_end - loop.time()),
                                             return_when=asyncio.FIRST_COMPLETED)
                events = [] if done else [_lease_expired(rid, pending[t]) for t in pending]
                for t in done or list(pending):
                    del pending[t]
                    if not done:
                        t.cancel()  # a late acknowledgement finds no call to answer
                    elif not t.cancelled():
                        events.append(t.result())
                if not pending:
                    self.worker.run_soon(self._drop, rid)  # every target answered or timed out: free now
                for ev in events:
                    yield cluster_pb2.PrefillEvent(transfer_done=ev)
        finally:
            self.pushes.pop(rid, None)
            for t in tasks:
                t.cancel()
            self.worker.run_soon(self._drop, rid)  # never skipped, even if this handler is being cancelled

    def _step_failed(self, e, rids: list[str], sentence: str) -> None:
        """Engine thread: a step of these prompts raised; their Prefill calls end INTERNAL."""
        for rid in rids:
            st = self.progress.pop(rid, None)
            if st is not None:
                self.worker.post(fail, st.first, _StepFailed(f"{sentence}; request {rid} ended"))

    def _drop(self, e, rid) -> None:
        """Engine thread: free a request's pages (its peers are done with them, it was cancelled,
        or it failed). A finished prefill is in the prefix cache already (`cache_prefix`)."""
        self.progress.pop(rid, None)
        if rid in e.seqs:
            e.release(rid, cache=False)
            self.pages.on_engine(e)  # pages freed: the first prompt waiting for pages tries

    def _export(self, e, rid, st, first, first_lp) -> None:
        """Engine thread: send the prompt tokens computed since the last export to every target
        (with P's first token and its logprob, a TokenLogprob or None, once sampled)."""
        seq = e.seqs[rid]
        upto = min(seq.pages.num_tokens, st.n)
        if upto > st.sent and st.queues:
            run = e.export_kv_shards(rid, st.sent, upto)  # each KV head range from its own device
            for q in st.queues:
                self.worker.post(q.put_nowait, (run, first, first_lp))
            st.sent = upto

    def _on_step(self, events) -> None:
        self.pages.on_engine(self.engine)
        firsts = {ev.seq_id: ev for ev in events if ev.position == 0}
        for rid, st in list(self.progress.items()):
            if rid not in self.engine.seqs:
                continue
            ev = firsts.get(rid)
            first = None if ev is None else ev.token
            first_lp = None if ev is None or ev.logprobs is None else rpc.logprob_to_pb(ev.logprobs)
            self._export(self.engine, rid, st, first, first_lp)  # KV streams out while prefill continues
            if first is not None:
                self.worker.post(resolve, st.first, (first, first_lp))
                if st.queues:  # held for the targets until they acknowledge (Prefill's KV lease)
                    self.engine.cache_prefix(rid)  # P's cache serves this prompt at once meanwhile
                else:
                    self.engine.release(rid, cache=True)
                del self.progress[rid]

    async def Release(self, request, context):
        """Idempotent; stops the request's pushes and frees its pages. A late one finds nothing."""
        rid = request.request_id
        tasks = self.pushes.pop(rid, [])
        for t in tasks:
            t.cancel()

        def release(e) -> bool:
            st = self.progress.pop(rid, None)
            if st is not None:  # still prefilling: its Prefill call ends ABORTED
                self.worker.post(fail, st.first, _Released(f"request {rid} was released on prefill"))
            if rid not in e.seqs:
                return False
            e.release(rid, cache=request.cache)
            return True

        found = await self.worker.call(release)
        return cluster_pb2.ReleaseResponse(found=bool(tasks) or found)

    async def Info(self, request, context):
        return await service_info(self.worker, self.info)

    async def MatchPrefix(self, request, context):
        return await match_prefix(self.worker, self.engine.config.page_size, request, context)


class _Released(Exception):
    """The request was released (Release RPC) while P was still prefilling it."""


class _StepFailed(Exception):
    """An engine step of the request raised (serving/engine/faults.py); one sentence."""


def _lease_expired(rid: str, target) -> cluster_pb2.TransferDone:
    return cluster_pb2.TransferDone(
        role=target.role, code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
        error=f"{target.address} did not acknowledge the KV of {rid} within {env.KV_LEASE_SECONDS.get():g} s of its "
              f"prefill; P freed it (PDDJAX_KV_LEASE_SECONDS)")


@dataclasses.dataclass
class _Progress:
    n: int  # prompt tokens
    sent: int  # prompt KV exported up to here
    queues: list  # one asyncio.Queue of (KVRun head pieces, first token or None, its TokenLogprob or None) per target
    first: asyncio.Future



