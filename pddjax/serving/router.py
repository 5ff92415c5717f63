"""The router: the user-facing streaming `Generate`, choosing pipelines and instances.

A request's life (pipeline pdd; the others drop a tier):
  1. tokenize and validate (INVALID_ARGUMENT with one sentence, nothing reserved); take an
     admission slot (`router_admission`: past max_inflight + max_queue -> RESOURCE_EXHAUSTED at
     once); the client's deadline becomes every downstream RPC's timeout;
  2. pick instances (`pools`): the least-loaded healthy P and RLD (ties: the session's last
     one), the MD that holds the session's context (affinity; else the least loaded); ask P's
     cache and MD's DRC how much of the prompt they hold (chained page hashes, no tokens move);
  3. auto: `policy.decide` from those hits, the KV bytes per token, the link's measured
     throughput and queue (`LinkEstimator`, fed by every completed transfer), RLD's measured
     decode speed, the TTFT budget and the session's history: pd-cross, pdd, or pd-local for
     singular traffic (filtered share capped; a session's filtered turn is synced to MD in the
     background afterwards so MD's hit rate never drifts behind P's). Logged, counted (`Stats`),
     and explained in the first response's `explain`;
  4. Reserve on MD (pins its DRC prefix -> cached_on_main; a full or gone MD falls back to the
     next; every MD full or gone: an `auto` request with an RLD goes pd-local, reason main-full /
     main-unavailable) and on RLD; the first message (pipeline, explain); open Decode streams;
  5. P.Prefill with targets RLD (from RLD's own prefix-cache hit, with the first token) and MD
     (from cached_on_main):
     P pushes both at once; RLD starts streaming tokens (relay) as soon as its KV lands;
  6. when P reports MD's KV delivered, RLD.Handoff: one-shot, or chunked while more than the
     threshold is pending (`handoff = "auto"`); RLD's stream ends with handed_off_at = N and
     MD's starts at N (main) -> no gap, duplicate or reorder;
  7. finish: every tier is released (idempotent), cancelled on client disconnect or deadline.
Metrics (TTFT, ITL, pipelines, handoffs, failures, WAN bytes): `router_metrics`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
import uuid

import grpc

from pddjax.kv.page_hash import chain_hashes
from pddjax.serving import pools, router_recovery, rpc
from pddjax.serving.config import RouterSettings
from pddjax.serving.pb import cluster_pb2, cluster_pb2_grpc, common_pb2, router_pb2, router_pb2_grpc
from pddjax.serving.policy import (PD_LOCAL, Ewma, FilterWindow, Inputs, LinkEstimator, PolicyConfig, SessionTracker,
                                   decide)
from pddjax.serving.router_admission import Admission, Deadline, Refused
from pddjax.serving.router_metrics import RouterMetrics

P = common_pb2
PIPELINE_NAMES = {P.PIPELINE_AUTO: "auto", P.PIPELINE_PDD: "pdd", P.PIPELINE_PD_CROSS: "pd-cross",
                  P.PIPELINE_PD_LOCAL: "pd-local"}
_PIPELINES = {v: k for k, v in PIPELINE_NAMES.items()}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, stage: str = ""):
        super().__init__(message)
        self.code, self.message, self.stage = code, message, stage  # stage: where it failed (metrics)


def _from_rpc(e: grpc.aio.AioRpcError, who: str) -> _Abort:
    return _Abort(e.code(), e.details() or f"{who} failed with {e.code().name}", who)


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, settings: RouterSettings, model_config, tokenizer):
        s = self.s = settings
        self.cfg, self.tok = model_config, tokenizer
        self._bg: set[asyncio.Task] = set()
        self.pools = {"prefill": pools.Pool("prefill", s.prefill), "relay": pools.Pool("relay", s.relay),
                      "main": pools.Pool("main", s.main, s.main_wan or s.main)}
        self.affinity = {r: pools.Affinity() for r in self.pools}
        self.policy = PolicyConfig(ttft_budget_s=s.ttft_budget_ms / 1e3, filter_cap=s.filter_cap,
                                   filter_window=s.filter_window, drift_tolerance=s.drift_tolerance,
                                   handoff_threshold=s.handoff_threshold)
        self.links: dict[str, LinkEstimator] = {}  # by MD address
        self.rld_speed: dict[str, Ewma] = {}  # by RLD address, tokens/s of one request
        self.sessions = SessionTracker()
        self.window = FilterWindow(s.filter_window)
        self.counters: collections.Counter = collections.Counter()
        self.admission = Admission(s.max_inflight, s.max_queue)  # bounded: RESOURCE_EXHAUSTED past it
        self.m = RouterMetrics(admission=self.admission)

    def attach_metrics(self, metrics) -> None:
        """server.py: the router's metrics join the service's registry (one /metrics endpoint)."""
        self.m = RouterMetrics(metrics.registry, self.admission)

    def start(self, loop) -> None:
        for pool in self.pools.values():
            for inst in pool.instances:
                inst.channel = pools.channel(inst.address)
        self._sync_lock = asyncio.Lock()  # background context syncs run one at a time (low priority)
        self._health = loop.create_task(pools.health_loop(list(self.pools.values()), self.s.health_interval_s,
                                                          self.s.health_timeout_s, self.counters))

    # ---- instances ---------------------------------------------------------------------
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

    async def _pick(self, role, sid, fn=None, sticky=False, exclude=()):
        """-> (instance, fn(instance)); an instance that fails with UNAVAILABLE leaves the rotation
        and the next one is tried; NoInstance when none is left."""
        tried = list(exclude)
        while True:
            inst = self.pools[role].pick(self.affinity[role].get(sid), sticky=sticky, exclude=tried)
            try:
                return inst, (await fn(inst) if fn else None)
            except grpc.aio.AioRpcError as e:
                if e.code() not in _RETRY:
                    raise
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    pools.set_health(inst, False, self.counters)
                tried.append(inst)
                self.counters[f"fallback.{role}"] += 1

    def _link(self, inst) -> LinkEstimator:
        if inst.address not in self.links:
            self.links[inst.address] = LinkEstimator(self.s.wan_mbps_prior, self.s.wan_latency_ms_prior / 1e3)
        return self.links[inst.address]

    def _speed(self, inst) -> Ewma:
        return self.rld_speed.setdefault(inst.address, Ewma(self.s.rld_tokens_per_s_prior))

    async def Stats(self, request, context):
        return router_pb2.StatsResponse(json=json.dumps(self.stats()))

    def stats(self) -> dict:
        return {"counters": dict(self.counters), "admission": self.admission.stats(),
                "links": {a: {"mbps": 8 * lk.throughput.value / 1e6, "latency_ms": 1e3 * lk.latency.value,
                              "queued_bytes": lk.queued, "samples": lk.throughput.samples}
                          for a, lk in self.links.items()},
                "rld_tokens_per_s": {a: e.value for a, e in self.rld_speed.items()},
                "filtered_share": self.window.share(),
                "instances": [{"role": i.role, "address": i.address, "healthy": i.healthy, "inflight": i.inflight}
                              for p in self.pools.values() for i in p.instances]}

    # ---- request parsing ---------------------------------------------------------------
    def _prompt(self, req) -> list[int]:
        kind = req.WhichOneof("prompt")
        if kind == "token_ids":
            return list(req.token_ids.ids)
        if kind is None:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "the request has no prompt")
        if self.tok is None:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"model {self.cfg.name} has no tokenizer: send token_ids")
        if kind == "text":
            return self.tok.encode(req.text) if req.text else []
        msgs = [{"role": m.role, "content": m.content} for m in req.chat.messages]
        if not msgs:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "the chat has no messages")
        try:
            return self.tok.encode(self.tok.apply_chat_template(msgs))
        except Exception as e:  # noqa: BLE001  (template errors are the user's)
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot render the chat: {e}") from None

    # ---- choosing ----------------------------------------------------------------------
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

    # ---- Generate ----------------------------------------------------------------------
    async def Generate(self, request, context):
        dl, job = Deadline.of(context), _Job()
        try:
            async for msg in self._generate(request, dl, job):
                yield msg
        except (_Abort, Refused) as e:
            self.m.failed(e.code.name, e.stage or job.stage)
            await context.abort(e.code, e.message)
        except asyncio.CancelledError:  # the client cancelled, or its deadline passed
            self.m.failed("DEADLINE_EXCEEDED" if dl.expired(slack_s=0.2) else "CANCELLED", job.stage)
            raise
        finally:
            if job.admitted:
                self.admission.leave()

    async def _generate(self, req, dl: Deadline, job: _Job):
        t0 = time.perf_counter()
        prompt = self._prompt(req)
        params = rpc.sampling_from_pb(req.sampling)
        max_tokens = int(req.max_tokens)
        rid = req.request_id or uuid.uuid4().hex
        sid = req.session_id
        err = rpc.validate_spec(self.cfg, rid, prompt, params, max_tokens)
        if err:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        if req.pipeline not in PIPELINE_NAMES:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown pipeline {req.pipeline}")
        bad = [t for t in req.stop_token_ids if t >= self.cfg.vocab_size]
        if bad:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"stop token id {bad[0]} is outside the vocabulary")
        stop_ids = tuple(() if req.ignore_eos else self.cfg.eos_token_ids) + tuple(req.stop_token_ids)
        mode = req.handoff or (P.HANDOFF_MODE_ONE_SHOT if self.s.handoff == "one-shot" else P.HANDOFF_MODE_CHUNKED)
        job.stage = "admission"
        await self.admission.enter(dl)  # Refused (RESOURCE_EXHAUSTED) past max_inflight + max_queue
        job.admitted, job.stage = True, "plan"
        pl = await self._plan(prompt, max_tokens, sid, req.pipeline, dl)
        pipeline = pl.pipeline
        spec = cluster_pb2.SequenceSpec(request_id=rid, prompt=prompt, sampling=rpc.sampling_to_pb(params),
                                        max_tokens=max_tokens, stop_token_ids=stop_ids)
        use_rld = pipeline in (P.PIPELINE_PDD, P.PIPELINE_PD_LOCAL)
        use_md = pipeline in (P.PIPELINE_PDD, P.PIPELINE_PD_CROSS)

        st = _State()
        st.deadline, timer = dl, self.m.timer(t0)
        relay_q: asyncio.Queue = asyncio.Queue()
        main_q: asyncio.Queue = asyncio.Queue()
        tasks: list[asyncio.Task] = []
        held = [pl.p] + ([pl.rld] if use_rld else [])  # instances this request loads (inflight)
        for inst in held:
            inst.inflight += 1
        md, finished, prefill = None, False, None
        md_tried: list = []  # every MD a Reserve was sent to: released even if it never answered

        def unhold():  # idempotent: this request no longer loads its instances
            while held:
                held.pop().inflight -= 1
        expiry = None
        try:
            job.stage = "reserve"
            try:
                if use_md:
                    try:
                        md, st.cached_md = await self._reserve_main(spec, sid, pl.md, md_tried, dl)
                    except grpc.aio.AioRpcError as e:
                        if not self._main_fallback(pl, req.pipeline, e):
                            raise
                        pipeline, use_md, use_rld = pl.pipeline, False, True  # auto -> pd-local via RLD
                        if pl.rld not in held:
                            held.append(pl.rld)
                            pl.rld.inflight += 1
                    else:
                        md.inflight += 1
                        held.append(md)
                if use_rld:  # RLD's own prefix cache (sessions stick to their RLD): P sends only the rest
                    st.cached_rld = (await self._stub(pl.rld).Reserve(cluster_pb2.ReserveRequest(
                        spec=spec, use_cache=True), timeout=dl.timeout())).cached_tokens
            except pools.NoInstance as e:
                raise _Abort(grpc.StatusCode.UNAVAILABLE, str(e)) from None
            except grpc.aio.AioRpcError as e:
                raise _from_rpc(e, "reserve") from None
            self.m.chosen(PIPELINE_NAMES[pipeline], pl.reason)
            print(f"router: {rid} session={sid or '-'} {pl.explain}", file=sys.stderr, flush=True)
            yield router_pb2.GenerateResponse(request_id=rid, pipeline=pipeline, prompt_token_ids=prompt,
                                              explain=pl.explain)
            job.stage = "stream"
            if dl.remaining() is not None:  # the stream stops at the deadline even if no tier reports it
                expiry = asyncio.get_running_loop().call_later(dl.remaining(), _expire, relay_q, main_q)
            if use_rld:
                call = self._stub(pl.rld).Decode(cluster_pb2.DecodeRequest(request_id=rid), timeout=dl.timeout())
                tasks.append(asyncio.create_task(_pump(call, relay_q, "relay", self._relay_lost(rid, md, st)
                                                       if pipeline == P.PIPELINE_PDD else None)))
            if use_md:
                call = self._stub(md).Decode(cluster_pb2.DecodeRequest(request_id=rid), timeout=dl.timeout())
                tasks.append(asyncio.create_task(_pump(call, main_q, "main")))
            targets = []
            if use_rld:
                targets.append(cluster_pb2.KVTarget(address=pl.rld.address, start=st.cached_rld, role=P.ROLE_RELAY,
                                                    include_first_token=True))
            if use_md:
                targets.append(cluster_pb2.KVTarget(address=md.wan_address, start=st.cached_md, role=P.ROLE_MAIN,
                                                    include_first_token=not use_rld))
                st.link, st.planned = self._link(md), (len(prompt) - st.cached_md) * await self._kv_bytes(pl.p)
                st.link.start(st.planned)
            preq = cluster_pb2.PrefillRequest(spec=spec, targets=targets, chunk_bytes=self.s.chunk_bytes)
            prefill = asyncio.create_task(self._prefill(pl.p, rid, preq, pipeline, mode, st, relay_q,
                                                        main_q, tasks, pl.rld, md))
            tasks.append(prefill)

            current, source = (relay_q, P.ROLE_RELAY) if use_rld else (main_q, P.ROLE_MAIN)
            tokens, sources, text, finish = [], [], "", P.FINISH_REASON_UNSPECIFIED
            while not finish:
                items = [await current.get()]
                while not current.empty() and not _terminal(items[-1]):
                    items.append(current.get_nowait())
                new, switch = [], False
                for it in items:
                    if isinstance(it, _Abort):
                        raise it
                    if it.token_ids and it.start_position != len(tokens) + len(new):
                        raise _Abort(grpc.StatusCode.INTERNAL, f"token stream out of order at position {it.start_position}")
                    new += it.token_ids
                    switch = switch or it.handed_off
                    finish = finish or it.finish_reason
                if not new and not finish:
                    if switch:
                        current, source, st.handoff_at = main_q, P.ROLE_MAIN, len(tokens)
                    continue
                now = time.perf_counter()
                if st.ttft is None and new:
                    st.ttft = now - t0
                if source == P.ROLE_RELAY and new:  # RLD's decode speed, after its first batch
                    st.relay_t0 = st.relay_t0 or now
                    st.relay_after += len(new) if now > st.relay_t0 else 0
                    st.relay_t1 = now
                tokens += new
                timer.tokens(PIPELINE_NAMES[pipeline], len(new), now)
                sources += [source] * len(new)
                delta, text, hit = self._text(tokens, text, req.stop_strings)
                if hit:
                    finish = P.FINISH_REASON_STOP
                msg = router_pb2.GenerateResponse(request_id=rid, token_ids=new, sources=[source] * len(new), text=delta)
                if finish:
                    msg.finish_reason = finish
                    msg.usage.CopyFrom(router_pb2.Usage(
                        prompt_tokens=len(prompt), cached_on_prefill=st.cached_p, cached_on_main=st.cached_md,
                        completion_tokens=len(tokens), relay_tokens=sources.count(P.ROLE_RELAY),
                        main_tokens=sources.count(P.ROLE_MAIN), kv_bytes_to_relay=st.bytes_rld,
                        kv_bytes_to_main=st.bytes_md, handoff_tokens=st.handoff_tokens,
                        handoff_chunks=st.handoff_chunks))
                    msg.timings.CopyFrom(router_pb2.Timings(
                        ttft_ms=1e3 * (st.ttft or 0), total_ms=1e3 * (time.perf_counter() - t0), prefill_ms=st.prefill_ms,
                        kv_to_main_ms=st.md_ms, handoff_position=st.handoff_at or 0))
                    # settle before the last message: the client's next turn sees this one's effects
                    finished = st.finished = True
                    unhold()
                    self._learn(pl, st, sid, tokens, md)
                    if pl.sync_main and len(prompt) + len(tokens) > 1:
                        self._spawn(self._sync_main(pl.p, pl.md, spec, prompt + tokens[:-1]))
                yield msg
                if switch:
                    current, source, st.handoff_at = main_q, P.ROLE_MAIN, len(tokens)
        finally:
            # RLD finished before MD held the KV (pdd): let the push finish in the background so
            # MD's DRC still gets the context (the drift-loop guard), then release
            complete = finished and md is not None and prefill is not None and not prefill.done()
            if expiry is not None:
                expiry.cancel()
            for t in tasks:
                if not (complete and t is prefill):
                    t.cancel()
            unhold()
            if not finished:
                self.counters["requests.failed"] += 1
            insts = [pl.p] + ([pl.rld] if use_rld else []) + ([md] if md else [])
            insts += [i for i in md_tried if i is not md]  # a cancel during Reserve must not orphan it
            if complete:
                self.counters["main_completed_in_background"] += 1
            self._spawn(self._release(rid, insts, prefill if complete else None, st))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _kv_bytes(self, p_inst) -> int:
        info = await self._info(p_inst)
        return 2 * info.num_layers * info.num_kv_heads * info.head_dim * _ITEMSIZE.get(info.dtype, 4)

    async def _reserve_main(self, spec, sid, first, attempted: list, dl: Deadline):
        """Reserve on the chosen MD; a full (RESOURCE_EXHAUSTED) or gone MD falls back to the
        least-loaded other one. -> (instance, cached tokens). `attempted` collects every MD
        asked, so the caller releases them all if it is cancelled midway."""
        inst, tried = first, []
        while True:
            try:
                attempted.append(inst)
                r = await self._stub(inst).Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=True),
                                                   timeout=dl.timeout())
                return inst, r.cached_tokens
            except grpc.aio.AioRpcError as e:
                if e.code() not in _RETRY:
                    raise
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    pools.set_health(inst, False, self.counters)
                tried.append(inst)
                self.counters["fallback.main"] += 1
                try:
                    inst = self.pools["main"].pick(exclude=tried)
                except pools.NoInstance:
                    raise e from None  # every MD is full or gone: the last one's answer

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
                target = cluster_pb2.KVTarget(address=md_inst.wan_address, start=cached, role=P.ROLE_MAIN)
                async for ev in p.Prefill(cluster_pb2.PrefillRequest(spec=sspec, targets=[target],
                                                                     chunk_bytes=self.s.chunk_bytes)):
                    if ev.HasField("transfer_done"):
                        d = ev.transfer_done
                        self.m.wan_bytes(d.bytes)
                        ok = not d.code
                        link.done(planned, d.bytes, d.ms / 1e3, ok)
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

    def _text(self, tokens, text, stop_strings) -> tuple[str, str, bool]:
        if self.tok is None:
            return "", "", False
        full = self.tok.decode(tokens, skip_special=True)
        if full.endswith("\ufffd"):  # hold back an incomplete UTF-8 sequence
            return "", text, False
        for s in stop_strings:
            i = full.find(s, max(0, len(text) - len(s)))
            if s and i >= 0:
                return full[len(text):i], full[:i], True
        return full[len(text):], full, False

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
                            if err:
                                relay_q.put_nowait(err)
                            continue
                        st.bytes_md, st.md_ms = d.bytes, d.ms
                        self.m.wan_bytes(d.bytes)
                        if st.link is not None:
                            st.link.done(st.planned, d.bytes, d.ms / 1e3, ok=not err)
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
                request_id=rid, main_address=md.wan_address, mode=mode, threshold=self.s.handoff_threshold),
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


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class _Plan:
    def __init__(self):
        self.p = self.rld = self.md = None  # pools.Instance
        self.hit_p = self.hit_md = 0
        self.pipeline, self.reason, self.explain, self.sync_main = P.PIPELINE_AUTO, "", "", False


class _Job:
    """What Generate needs to know about its request, whatever stage it failed in."""

    def __init__(self):
        self.stage = "validate"  # validate | admission | plan | reserve | stream (failure metrics)
        self.admitted = False  # holds an admission slot (released by Generate)


class _State:
    def __init__(self):
        self.cached_p = self.cached_md = self.cached_rld = 0
        self.bytes_rld = self.bytes_md = 0
        self.prefill_ms = self.md_ms = 0.0
        self.ttft = None
        self.handoff_at = None
        self.handoff_tokens = self.handoff_chunks = 0
        self.link, self.planned, self.link_done = None, 0, False  # MD's link estimator, bytes planned on it
        self.relay_t0 = self.relay_t1 = 0.0  # first and last relay batch (perf_counter)
        self.relay_after = 0  # relay tokens after the first batch
        self.finished = False  # the user's stream has its last message
        self.deadline = Deadline(None)  # the client's: every downstream RPC's timeout
        self.first_token = None  # P's (router_recovery: MD taking over before RLD sent any token)
        self.md_kv, self.md_kv_ok = asyncio.Event(), False  # P reported MD's KV transfer (delivered?)
        self.relay_lost = False  # RLD's stream broke: MD took over (or tried); no RLD handoff
        self.p_tried, self.p_extra = [], []  # P instances that failed / replaced them (router_recovery)


def _expire(*queues) -> None:
    """The client's deadline passed: the stream fails with DEADLINE_EXCEEDED (then releases all)."""
    for q in queues:
        q.put_nowait(_Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed before it finished"))


def _terminal(item) -> bool:
    return isinstance(item, _Abort) or bool(item.finish_reason) or item.handed_off


async def _pump(call, q: asyncio.Queue, who: str, on_error=None) -> None:
    """A tier's token stream into `q`; a failure becomes an _Abort, or what `on_error(err, tokens
    forwarded so far)` makes of it (pdd's RLD: MD taking over)."""
    seen: list[int] = []
    try:
        async for batch in call:
            q.put_nowait(batch)
            seen += batch.token_ids
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            err = _from_rpc(e, who)
            q.put_nowait(await on_error(err, seen) if on_error else err)
