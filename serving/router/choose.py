"""How the router chooses (a mixin of `RouterService`): instances from the pools (least
loaded, session affinity, UNAVAILABLE ones leave the rotation), the prefix hits of P and MD
(page hashes, no tokens move), the auto policy's decision from measured link and RLD speeds,
MD's reservation (a full or gone MD: the next one; none left: `auto` goes pd-local), and what
a finished request teaches (RLD speed, output length, affinity)."""

from __future__ import annotations

import grpc

from pddjax.kv.page_hash import chain_hashes
from pddjax.policy import PD_LOCAL, Ewma, Inputs, LinkEstimator, decide
from serving.pb import cluster_pb2, cluster_pb2_grpc
from serving.router import pools
from serving.router.admission import Deadline
from serving.router.request import _ITEMSIZE, _PIPELINES, _RETRY, PIPELINE_NAMES, P, _Abort, _from_rpc, _Plan


class Choosing:
    @staticmethod
    def _stub(inst):
        return (cluster_pb2_grpc.PrefillStub if inst.role == "prefill" else cluster_pb2_grpc.DecodeStub)(inst.channel)

    async def _info(self, inst):
        if inst.info is None:
            inst.info = await self._stub(inst).Info(cluster_pb2.InfoRequest(), timeout=30)
        return inst.info

    async def _hit(self, inst, prompt, dl: Deadline) -> int:
        S = (await self._info(inst)).page_size
        m = await self._stub(inst).MatchPrefix(
            cluster_pb2.MatchPrefixRequest(page_size=S, page_hashes=chain_hashes(prompt, S)), timeout=dl.timeout(30))
        return m.matched_tokens

    async def _pick(self, role, sid, fn=None, sticky=False, exclude=(), first=None, attempted=None):
        """-> (instance, fn(instance)): `first` if given, else the pool's pick (affinity, least
        loaded). An instance that fails with UNAVAILABLE (leaves the rotation) or
        RESOURCE_EXHAUSTED is skipped and the next one tried; when none is left: NoInstance if
        nothing was tried, else the last instance's error. `attempted` collects every instance
        asked (the caller releases them all if it is cancelled midway)."""
        tried, err = list(exclude), None
        while True:
            try:
                inst = first if first is not None and err is None else \
                    self.pools[role].pick(self.affinity[role].get(sid), sticky=sticky, exclude=tried)
            except pools.NoInstance:
                if err is None:
                    raise
                raise err from None
            if attempted is not None:
                attempted.append(inst)
            try:
                return inst, (await fn(inst) if fn else None)
            except grpc.aio.AioRpcError as e:
                if e.code() not in _RETRY:
                    raise
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    pools.set_health(inst, False, self.counters)
                tried.append(inst)
                err = e
                self.counters[f"fallback.{role}"] += 1

    def _link(self, inst) -> LinkEstimator:
        if inst.address not in self.links:
            self.links[inst.address] = LinkEstimator(self.s.wan_mbps_prior, self.s.wan_latency_ms_prior / 1e3)
        return self.links[inst.address]

    def _speed(self, inst) -> Ewma:
        return self.rld_speed.setdefault(inst.address, Ewma(self.s.rld_tokens_per_s_prior))

    async def _kv_bytes(self, p_inst) -> int:
        info = await self._info(p_inst)
        return 2 * info.num_layers * info.num_kv_heads * info.head_dim * _ITEMSIZE.get(info.dtype, 4)

    async def _plan(self, prompt, max_tokens, sid, requested, dl: Deadline) -> _Plan:
        """Instances, hits and (auto) the policy's decision; counted and logged."""
        pl = _Plan()
        try:
            pl.p, pl.hit_p = await self._pick("prefill", sid, lambda i: self._hit(i, prompt, dl))
            if requested != P.PIPELINE_PD_LOCAL:
                try:
                    pl.md, pl.hit_md = await self._pick("main", sid, lambda i: self._hit(i, prompt, dl), sticky=True)
                except pools.NoInstance:
                    if requested != P.PIPELINE_AUTO:
                        raise
            if requested != P.PIPELINE_PD_CROSS:
                pl.rld, _ = await self._pick("relay", sid)
        except pools.NoInstance as e:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except grpc.aio.AioRpcError as e:
            raise _from_rpc(e, "prefix match") from None
        pl.pipeline = requested
        if requested == P.PIPELINE_AUTO and pl.md is None:
            pl.pipeline, pl.reason = P.PIPELINE_PD_LOCAL, "no-main"
            pl.explain = "pd-local (no-main): no healthy MD instance"
        elif requested == P.PIPELINE_AUTO:
            info = await self._info(pl.p)
            link = self._link(pl.md)
            i = Inputs(prompt_tokens=len(prompt), max_tokens=max_tokens, hit_prefill=pl.hit_p, hit_main=pl.hit_md,
                       kv_bytes_per_token=2 * info.num_layers * info.num_kv_heads * info.head_dim
                       * _ITEMSIZE.get(info.dtype, 4),
                       wan_bytes_per_s=link.throughput.value, wan_latency_s=link.latency.value,
                       wan_queue_bytes=link.queued, rld_tokens_per_s=self._speed(pl.rld).value,
                       filtered_share=self.window.share(), session_id=sid,
                       predicted_output=self.sessions.predicted_output(sid), session_drift=self.sessions.drift(sid))
            d = decide(i, self.policy)
            self.window.add(d.pipeline == PD_LOCAL)
            pl.pipeline, pl.reason, pl.sync_main = _PIPELINES[d.pipeline], d.reason, d.sync_main
            pl.explain = d.explain(i)
        else:
            pl.reason = "requested"
            pl.explain = (f"{PIPELINE_NAMES[requested]} (requested): hit P {pl.hit_p}/{len(prompt)}"
                          + (f", MD {pl.hit_md}/{len(prompt)}" if pl.md else ""))
        self.counters[f"decision.{PIPELINE_NAMES[pl.pipeline]}.{pl.reason}"] += 1
        if pl.md is not None:
            self.sessions.record_hits(sid, len(prompt), pl.hit_p, pl.hit_md)
            self.counters["prompt_tokens"] += len(prompt)
            self.counters["hit_prefill_tokens"] += pl.hit_p
            self.counters["hit_main_tokens"] += pl.hit_md
        use = [x for x in (("P", pl.p), ("RLD", pl.rld if pl.pipeline != P.PIPELINE_PD_CROSS else None),
                           ("MD", pl.md if pl.pipeline != P.PIPELINE_PD_LOCAL or pl.sync_main else None)) if x[1]]
        pl.explain += " [" + ", ".join(f"{n} {inst.address}" for n, inst in use) + "]"
        return pl

    async def _reserve_main(self, spec, sid, first, attempted: list, dl: Deadline):
        """Reserve on the chosen MD; a full (RESOURCE_EXHAUSTED) or gone MD falls back to the
        least-loaded other one. -> (instance, cached tokens); every MD full or gone: the last
        one's error."""
        async def reserve(inst):
            return (await self._stub(inst).Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=True),
                                                   timeout=dl.timeout())).cached_tokens
        return await self._pick("main", sid, reserve, first=first, attempted=attempted)

    def _main_fallback(self, pl, requested, e: grpc.aio.AioRpcError) -> bool:
        """Every MD is full or gone: an `auto` request that has an RLD is served pd-local instead
        (counted and explained); an explicit pd-cross or pdd keeps the error (-> False)."""
        if requested != P.PIPELINE_AUTO or pl.rld is None or e.code() not in _RETRY:
            return False
        why = "main-full" if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "main-unavailable"
        self.counters[f"fallback.pd-local.{why}"] += 1
        pl.explain = (f"pd-local ({why}): MD answered {e.code().name} ({e.details()}), so P -> RLD only; "
                      f"the policy had chosen {pl.explain}")
        pl.pipeline, pl.reason, pl.sync_main = P.PIPELINE_PD_LOCAL, why, False
        return True

    def _learn(self, pl, st, sid, tokens, md) -> None:
        """After a finished request: RLD's speed, the session's output length and affinity."""
        self.counters[f"requests.{PIPELINE_NAMES[pl.pipeline]}"] += 1
        self.m.done(PIPELINE_NAMES[pl.pipeline])
        if st.relay_after >= 4 and st.relay_t1 > st.relay_t0:
            self._speed(pl.rld).add(st.relay_after / (st.relay_t1 - st.relay_t0))
        self.sessions.record_output(sid, len(tokens))
        self.affinity["prefill"].set(sid, pl.p.address)
        if pl.rld is not None:
            self.affinity["relay"].set(sid, pl.rld.address)
        if md is not None or pl.sync_main:
            self.affinity["main"].set(sid, (md or pl.md).address)
