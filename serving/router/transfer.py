"""The router's transfers (a mixin of `RouterService`): P's events for a request (KV
delivered to RLD / MD, a failed P replaced, MD's KV landing -> RLD's handoff), MD taking over
when RLD's stream breaks, the background context sync of a filtered turn, and the release of
every tier a request touched."""

from __future__ import annotations

import asyncio

import grpc

from serving.pb import cluster_pb2
from serving.router import recovery as router_recovery
from serving.router.request import _CODES, P, _Abort, _from_rpc


class Transfers:
    async def _sync_main(self, p_inst, md_inst, spec, context) -> None:
        """A filtered (pd-local) turn of a session: push its context's KV to MD anyway, after the
        user's request finished and one sync at a time, so the session's next turn hits MD's DRC."""
        async with self._sync_lock:
            rid = f"sync-{spec.request_id}"
            sspec = cluster_pb2.SequenceSpec(request_id=rid, prompt=context, sampling=spec.sampling, max_tokens=1,
                                             stop_token_ids=spec.stop_token_ids)
            md, p, ok, link, planned = self._stub(md_inst), self._stub(p_inst), False, self._link(md_inst), 0
            try:
                cached = (await md.Reserve(cluster_pb2.ReserveRequest(spec=sspec, use_cache=True))).cached_tokens
                planned = (len(context) - cached) * await self._kv_bytes(p_inst)
                link.start(planned)
                target = cluster_pb2.KVTarget(address=md_inst.kv_address, start=cached, role=P.ROLE_MAIN)
                async for ev in p.Prefill(cluster_pb2.PrefillRequest(spec=sspec, targets=[target],
                                                                     chunk_bytes=self.s.chunk_bytes)):
                    if ev.HasField("transfer_done"):
                        d = ev.transfer_done
                        self.m.wan_bytes(d.bytes)
                        ok = not d.code
                        link.done(planned, d.bytes, (d.wire_ms or d.ms) / 1e3, ok)
                        planned = 0
            except grpc.aio.AioRpcError:
                pass
            finally:
                if planned:
                    link.done(planned, 0, 0.0, ok=False)
                self.counters["sync_main." + ("done" if ok else "failed")] += 1
                await asyncio.gather(md.Release(cluster_pb2.ReleaseRequest(request_id=rid, cache=ok, cancel=True)),
                                     p.Release(cluster_pb2.ReleaseRequest(request_id=rid, cache=True, cancel=True)),
                                     return_exceptions=True)

    async def _prefill(self, p, rid, preq, pipeline, mode, st, relay_q, main_q, tasks, rld, md):
        """P's events for one request (p: the P instance). A P that fails mid-request is replaced
        and only the KV that has not arrived is pushed again (router_recovery)."""
        reported: set = set()  # roles whose transfer P reported (delivered or failed)
        try:
            while True:
                try:
                    async for ev in self._stub(p).Prefill(preq, timeout=st.deadline.timeout()):
                        if ev.HasField("prefilled"):
                            st.cached_p, st.prefill_ms = ev.prefilled.num_cached, ev.prefilled.prefill_ms
                            st.first_token = ev.prefilled.first_token
                            continue
                        d = ev.transfer_done
                        err = _Abort(_CODES.get(d.code, grpc.StatusCode.UNKNOWN), d.error, "transfer") if d.code else None
                        reported.add(d.role)
                        if d.role == P.ROLE_RELAY:
                            st.bytes_rld = d.bytes
                            if err and pipeline == P.PIPELINE_PDD and md is not None \
                                    and d.code != grpc.StatusCode.FAILED_PRECONDITION.value[0]:
                                # RLD never got its KV (it decodes nothing without it): MD serves it all
                                tasks.append(asyncio.create_task(router_recovery.relay_kv_failed(
                                    self, rid, md, st, err, relay_q)))
                            elif err:
                                relay_q.put_nowait(err)
                            continue
                        st.bytes_md, st.md_ms = d.bytes, d.ms
                        self.m.wan_bytes(d.bytes)
                        if st.link is not None:
                            st.link.done(st.planned, d.bytes, (d.wire_ms or d.ms) / 1e3, ok=not err)
                            st.link_done = True
                        router_recovery.main_transfer(self, md, st, err and err.code, d.error)
                        if err and pipeline == P.PIPELINE_PD_CROSS:
                            main_q.put_nowait(err)
                        elif err and d.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]:
                            relay_q.put_nowait(err)  # MD refuses this KV: never decode it anywhere
                        elif not err and pipeline == P.PIPELINE_PDD and not st.finished and not st.relay_lost:
                            tasks.append(asyncio.create_task(self._handoff(rld, md, rid, mode, st)))
                    return
                except grpc.aio.AioRpcError as e:
                    left = [t for t in preq.targets if t.role not in reported]
                    nxt = router_recovery.next_prefill(self, p, e, st) if left else None
                    if nxt is None:
                        for t in left:
                            (relay_q if t.role == P.ROLE_RELAY else main_q).put_nowait(_from_rpc(e, "prefill"))
                        return
                    p, preq = nxt, cluster_pb2.PrefillRequest(spec=preq.spec, targets=left, chunk_bytes=preq.chunk_bytes)
        finally:
            if not st.md_kv.is_set():
                router_recovery.main_transfer(self, None, st, grpc.StatusCode.UNAVAILABLE)

    def _relay_lost(self, rid, md, st):
        """on_error of RLD's stream (pdd): MD takes the request over, or the error stands."""
        async def on_error(err, seen):
            why = await router_recovery.take_over(self, rid, md, st, seen)
            return why if isinstance(why, cluster_pb2.TokenBatch) else _Abort(err.code, f"{err.message}; {why}", "relay")
        return on_error

    async def _handoff(self, rld, md, rid, mode, st):
        try:
            r = await self._stub(rld).Handoff(cluster_pb2.HandoffRequest(
                request_id=rid, main_address=md.kv_address, mode=mode, threshold=self.s.handoff_threshold),
                timeout=st.deadline.timeout())
            if r.handed_off:
                st.handoff_tokens, st.handoff_chunks = r.tokens, r.chunks
                self.m.handoff(r.chunks)
                self.counters["handoff." + ("chunked" if r.chunks > 1 else "one-shot")] += 1
        except grpc.aio.AioRpcError:
            pass  # RLD keeps decoding and finishes the request itself

    async def _release(self, rid, insts, pending=None, st=None):
        if pending is not None:
            try:
                await asyncio.wait_for(pending, timeout=self.s.background_timeout_s)
            except (TimeoutError, asyncio.CancelledError):
                pass
        if st is not None and st.link is not None and not st.link_done:
            st.link.done(st.planned, 0, 0.0, ok=False)
        if st is not None:  # a P that replaced a failed one
            insts = list(insts) + [i for i in st.p_extra if i not in insts]
        req = cluster_pb2.ReleaseRequest(request_id=rid, cache=True, cancel=True)
        await asyncio.gather(*(self._stub(i).Release(req) for i in insts), return_exceptions=True)
