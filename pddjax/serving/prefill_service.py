"""The Prefill service (P). One engine, one engine thread; concurrent prompts are batched by
the engine's packed step.

Prefill(spec, targets): add() with max_tokens=1 (own prefix cache), wait for the first token,
export the KV once in the canonical form from the smallest target start, release the
sequence into P's prefix cache, then push to every target at once (dual path: all of it to
RLD, MD's missing suffix to MD), each as a stream of KV chunks. The response stream reports
`prefilled` and one `transfer_done` per target (with its error code if it failed).
"""

from __future__ import annotations

import asyncio
import time

import grpc

from pddjax.kv.allocator import OutOfPages
from pddjax.serving import kvwire, rpc
from pddjax.serving.decode_service import validate_spec
from pddjax.serving.pb import cluster_pb2, cluster_pb2_grpc
from pddjax.serving.worker import EngineWorker


class PrefillService(cluster_pb2_grpc.PrefillServicer):
    def __init__(self, engine, model_config, info: dict):
        self.engine, self.cfg, self.info = engine, model_config, info
        self.first: dict[str, asyncio.Future] = {}  # request -> first token
        self.pushes: dict[str, list[asyncio.Task]] = {}
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.worker: EngineWorker | None = None

    def start(self, loop) -> None:
        self.worker = EngineWorker(self.engine, loop, self._on_step, name="engine-prefill")

    def _on_step(self, events) -> None:
        for ev in events:
            fut = self.first.get(ev.seq_id)
            if fut is not None and ev.position == 0:
                self.worker.post(_resolve, fut, ev.token)

    async def Info(self, request, context):
        pages, n = await self.worker.call(lambda e: (e.num_pages_active, len(e.seqs)))
        return cluster_pb2.ServiceInfo(**self.info, pages_active=pages, requests=n)

    async def MatchPrefix(self, request, context):
        S = self.engine.config.page_size
        if request.page_size != S:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"page hashes must be computed at page size {S}, got {request.page_size}")
        pages = await self.worker.call(lambda e: e.prefix_hit_by_hashes(list(request.page_hashes)))
        return cluster_pb2.MatchPrefixResponse(matched_pages=pages, matched_tokens=pages * S, page_size=S)

    async def Prefill(self, request, context):
        rid, prompt, params, max_tokens, stop_ids = rpc.spec_from_pb(request.spec)
        err = validate_spec(self.cfg, rid, prompt, params, max_tokens)
        if err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        if rid in self.first or rid in self.pushes:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already on prefill")
        fut = asyncio.get_running_loop().create_future()
        self.first[rid] = fut
        t0 = time.perf_counter()
        try:
            try:
                cached = await self.worker.call(
                    lambda e: e.add(rid, prompt, params, 1, stop_ids, hold_on_finish=True).pages.num_cached)
            except OutOfPages:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the prefill pool cannot hold {len(prompt)} tokens now")
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            first = await fut
            targets = list(request.targets)
            start0 = min((t.start for t in targets), default=len(prompt))
            start0 = min(start0, len(prompt) - 1)

            def export_and_release(e):
                run = e.export_kv(rid, start0, len(prompt)) if targets else None
                e.release(rid, cache=True)
                return run

            run = await self.worker.call(export_and_release)
        except BaseException:
            await self.worker.call(lambda e: e.release(rid, cache=False) if rid in e.seqs else None)
            raise
        finally:
            self.first.pop(rid, None)
        yield cluster_pb2.PrefillEvent(prefilled=cluster_pb2.Prefilled(
            first_token=first, num_cached=cached, prefill_ms=1e3 * (time.perf_counter() - t0)))
        chunk_bytes = request.chunk_bytes or rpc.DEFAULT_CHUNK_BYTES
        tasks = [asyncio.create_task(self._push(rid, t, run, first, chunk_bytes)) for t in targets]
        self.pushes[rid] = tasks
        try:
            for done in asyncio.as_completed(tasks):
                try:
                    ev = await done
                except asyncio.CancelledError:
                    continue
                yield cluster_pb2.PrefillEvent(transfer_done=ev)
        finally:
            self.pushes.pop(rid, None)
            for t in tasks:
                t.cancel()

    async def _push(self, rid, target, run, first, chunk_bytes) -> cluster_pb2.TransferDone:
        ch = self.channels.get(target.address) or rpc.channel(target.address)
        self.channels[target.address] = ch
        stub = cluster_pb2_grpc.DecodeStub(ch)
        known = [first] if target.include_first_token else []
        pieces = list(kvwire.chunks(rid, run, max(target.start, run.start), known, chunk_bytes))
        nbytes = sum(len(c.k) + len(c.v) for c in pieces)
        t0 = time.perf_counter()
        done = cluster_pb2.TransferDone(role=target.role, bytes=nbytes, tokens=run.end - max(target.start, run.start),
                                        chunks=len(pieces))
        try:
            await stub.PushKV(iter(pieces))
        except grpc.aio.AioRpcError as e:
            done.code, done.error = e.code().value[0], e.details() or str(e.code())
        done.ms = 1e3 * (time.perf_counter() - t0)
        return done

    async def Release(self, request, context):
        tasks = self.pushes.pop(request.request_id, [])
        for t in tasks:
            t.cancel()
        found = await self.worker.call(
            lambda e: e.release(request.request_id, cache=request.cache) is None if request.request_id in e.seqs else False)
        return cluster_pb2.ReleaseResponse(found=bool(tasks) or found)


def _resolve(fut, value) -> None:
    if not fut.done():
        fut.set_result(value)
