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
Metrics (TTFT, ITL, pipelines, handoffs, failures, WAN bytes): `router_metrics`. Choosing
(steps 2-4): `router_choose`; P's events, handoff, recovery, release: `router_transfer`;
request state and stream plumbing: `router_state`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
import uuid

import grpc

from pddjax.policy import Ewma, FilterWindow, LinkEstimator, PolicyConfig, SessionTracker
from serving import rpc
from serving.config import RouterSettings
from serving.pb import cluster_pb2, router_pb2, router_pb2_grpc
from serving.router import pools
from serving.router.admission import Admission, Deadline, Refused
from serving.router.choose import Choosing
from serving.router.metrics import RouterMetrics
from serving.router.request import PIPELINE_NAMES, P, _Abort, _expire, _from_rpc, _Job, _pump, _State, _terminal
from serving.router.transfer import Transfers


class RouterService(Choosing, Transfers, router_pb2_grpc.RouterServicer):
    def __init__(self, settings: RouterSettings, model_config, tokenizer):
        s = self.s = settings
        self.cfg, self.tok = model_config, tokenizer
        self._bg: set[asyncio.Task] = set()
        self.pools = {"prefill": pools.Pool("prefill", s.prefill), "relay": pools.Pool("relay", s.relay, s.relay_kv),
                      "main": pools.Pool("main", s.main, s.main_wan)}
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
        held = st.held = [pl.p] + ([pl.rld] if use_rld else [])  # instances this request loads (inflight)
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
                st.relay_pump = asyncio.create_task(_pump(call, relay_q, "relay", self._relay_lost(rid, md, st)
                                                          if pipeline == P.PIPELINE_PDD else None))
                tasks.append(st.relay_pump)
            if use_md:
                call = self._stub(md).Decode(cluster_pb2.DecodeRequest(request_id=rid), timeout=dl.timeout())
                tasks.append(asyncio.create_task(_pump(call, main_q, "main")))
            targets = []
            if use_rld:
                targets.append(cluster_pb2.KVTarget(address=pl.rld.kv_address, start=st.cached_rld, role=P.ROLE_RELAY,
                                                    include_first_token=True))
            if use_md:
                targets.append(cluster_pb2.KVTarget(address=md.kv_address, start=st.cached_md, role=P.ROLE_MAIN,
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
