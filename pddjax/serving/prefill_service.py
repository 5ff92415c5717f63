"""The Prefill service (P). One engine, one engine thread; concurrent prompts are batched by
the engine's packed step.

Prefill(spec, targets): add() with max_tokens=1 (own prefix cache). After every engine step
the prompt tokens computed so far are exported in the canonical form and streamed to every
target at once (dual path: all of it to RLD, only MD's missing suffix to MD), so the transfer
overlaps the (chunked) prefill; the step that samples the first token exports the rest, the
first token rides on the last chunk, and P releases the sequence into its prefix cache. The
response stream reports `prefilled` and one `transfer_done` per target (with its error code).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc

from pddjax.kv.allocator import OutOfPages
from pddjax.serving import kvwire, rpc
from pddjax.serving.engine_rpcs import EngineRpcs
from pddjax.serving.pb import cluster_pb2, cluster_pb2_grpc
from pddjax.serving.worker import EngineWorker


class PrefillService(EngineRpcs, cluster_pb2_grpc.PrefillServicer):
    def __init__(self, engine, model_config, info: dict):
        self.engine, self.cfg, self.info = engine, model_config, info
        self.progress: dict[str, _Progress] = {}  # requests still prefilling (engine thread)
        self.pushes: dict[str, list[asyncio.Task]] = {}
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.worker: EngineWorker | None = None

    def start(self, loop) -> None:
        self.worker = EngineWorker(self.engine, loop, self._on_step, name="engine-prefill")

    async def Prefill(self, request, context):
        rid, prompt, params, max_tokens, stop_ids = rpc.spec_from_pb(request.spec)
        err = rpc.validate_spec(self.cfg, rid, prompt, params, max_tokens)
        if err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        if rid in self.progress or rid in self.pushes:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already on prefill")
        targets, n = list(request.targets), len(prompt)
        start0 = min(min((t.start for t in targets), default=n), n - 1)
        st = _Progress(n, start0, [asyncio.Queue() for _ in targets], asyncio.get_running_loop().create_future())
        self.progress[rid] = st
        t0 = time.perf_counter()

        def admit(e):
            seq = e.add(rid, prompt, params, 1, stop_ids, hold_on_finish=True)
            self._export(e, rid, st, None)  # the part P's prefix cache already holds goes out at once
            return seq.pages.num_cached

        chunk_bytes = request.chunk_bytes or rpc.DEFAULT_CHUNK_BYTES
        tasks: list[asyncio.Task] = []
        try:
            try:
                cached = await self.worker.call(admit)
            except OutOfPages:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the prefill pool cannot hold {n} tokens now")
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            tasks = [asyncio.create_task(self._push(rid, t, q, max(t.start, start0), n, chunk_bytes))
                     for t, q in zip(targets, st.queues)]
            self.pushes[rid] = tasks
            first = await st.first
            yield cluster_pb2.PrefillEvent(prefilled=cluster_pb2.Prefilled(
                first_token=first, num_cached=cached, prefill_ms=1e3 * (time.perf_counter() - t0)))
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
            self.worker.run_soon(self._drop, rid)  # never skipped, even if this handler is being cancelled

    def _drop(self, e, rid) -> None:
        """Engine thread: forget a request that ended early (cancelled, failed)."""
        self.progress.pop(rid, None)
        if rid in e.seqs:
            e.release(rid, cache=False)

    def _export(self, e, rid, st, first) -> None:
        """Engine thread: send the prompt tokens computed since the last export to every target."""
        seq = e.seqs[rid]
        upto = min(seq.pages.num_tokens, st.n)
        if upto > st.sent and st.queues:
            run = e.export_kv(rid, st.sent, upto)
            for q in st.queues:
                self.worker.post(q.put_nowait, (run, first))
            st.sent = upto

    def _on_step(self, events) -> None:
        firsts = {ev.seq_id: ev.token for ev in events if ev.position == 0}
        for rid, st in list(self.progress.items()):
            if rid not in self.engine.seqs:
                continue
            first = firsts.get(rid)
            self._export(self.engine, rid, st, first)  # KV streams out while prefill continues
            if first is not None:
                self.worker.post(_resolve, st.first, first)
                self.engine.release(rid, cache=True)  # into P's prefix cache; the KV is on the host now
                del self.progress[rid]

    async def _push(self, rid, target, q, start, end, chunk_bytes) -> cluster_pb2.TransferDone:
        ch = self.channels.get(target.address) or rpc.channel(target.address)
        self.channels[target.address] = ch
        stub = cluster_pb2_grpc.DecodeStub(ch)
        chunker = kvwire.Chunker(rid, start, end, chunk_bytes)

        async def stream():
            while chunker.next_pos < end:
                run, first = await q.get()
                known = [first] if first is not None and target.include_first_token else []
                for c in chunker.feed(run, known):
                    yield c

        t0 = time.perf_counter()
        done = cluster_pb2.TransferDone(role=target.role, tokens=end - start)
        try:
            await stub.PushKV(stream())
        except grpc.aio.AioRpcError as e:
            done.code, done.error = e.code().value[0], e.details() or str(e.code())
        done.bytes, done.chunks, done.ms = chunker.bytes, chunker.seq, 1e3 * (time.perf_counter() - t0)
        return done

    async def Release(self, request, context):
        tasks = self.pushes.pop(request.request_id, [])
        for t in tasks:
            t.cancel()
        found = await self.worker.call(
            lambda e: e.release(request.request_id, cache=request.cache) is None if request.request_id in e.seqs else False)
        return cluster_pb2.ReleaseResponse(found=bool(tasks) or found)


@dataclasses.dataclass
class _Progress:
    n: int  # prompt tokens
    sent: int  # prompt KV exported up to here
    queues: list  # one asyncio.Queue of (KVRun, first token or None) per target
    first: asyncio.Future


def _resolve(fut, value) -> None:
    if not fut.done():
        fut.set_result(value)

