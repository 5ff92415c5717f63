"""How the router chooses, for one request at a time (`Chooser`, passed the pools, the settings,
the measured estimates and the counters):

  - `pick`: an instance of a role from its pool (session affinity, least loaded); one that
    answers UNAVAILABLE leaves the rotation and, like a full one (RESOURCE_EXHAUSTED), is
    skipped for the next;
  - `plan`: P and (unless pd-cross was asked) RLD, the session's MD (unless pd-local was
    asked), the prefix hits of P and MD (chained page hashes, no tokens move; both asked at
    once) and, for `auto`, the policy's decision from those hits, the link's measured
    throughput and queue (waiting, boundedly, for the MD's first link probe), RLD's measured
    speed, the filtered share and the session's history; counted and explained (with the link
    estimate's source and age);
  - `reserve`: Reserve on MD (pins its DRC prefix; a full or gone MD: the next one; every MD
    full or gone: an `auto` request with an RLD goes pd-local, reason main-full /
    main-unavailable) and on RLD (its own prefix hit; beside MD's for `auto`, whose MD never
    waits for pages); the instances used are held;
  - `learn`: what a finished request teaches (RLD's speed, the session's output length, which
    instances hold the session's context).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc

from pddjax.kv.page_hash import chain_hashes
from pddjax.policy import PD_LOCAL, FilterWindow, Inputs, PolicyConfig, SessionTracker, decide
from serving.pb import cluster_pb2, common_pb2
from serving.router import pools
from serving.router.request import PIPELINE_NAMES, PIPELINES, Abort, Request, from_rpc

if TYPE_CHECKING:
    import collections

    from serving.config import RouterSettings
    from serving.router.estimates import Estimates
    from serving.router.metrics import RouterMetrics

_RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)  # try the next instance


class Chooser:
    def __init__(self, by_role: dict[str, pools.Pool], settings: RouterSettings, estimates: Estimates,
                 counters: collections.Counter, metrics: RouterMetrics):
        s = settings
        self.pools, self.estimates, self.counters, self.m = by_role, estimates, counters, metrics
        self.policy = PolicyConfig(ttft_budget_s=s.ttft_budget_ms / 1e3, filter_cap=s.filter_cap,
                                   filter_window=s.filter_window, drift_tolerance=s.drift_tolerance,
                                   handoff_threshold=s.handoff_threshold)
        self.affinity = {role: pools.Affinity() for role in by_role}  # session -> the instance with its context
        self.sessions = SessionTracker()
        self.window = FilterWindow(s.filter_window)  # the last decisions: filtered (pd-local) or not
        self.probe_wait_s = s.wan_probe_wait_ms / 1e3  # a request waits this long at most for its MD's first probe
        self.probe_on = s.wan_probe

    async def pick(self, role: str, session: str, fn=None, sticky=False, first=None, attempted=None):
        """-> (instance, fn(instance)): `first` if given, else the pool's pick (affinity, least
        loaded). An instance that fails with UNAVAILABLE (leaves the rotation) or
        RESOURCE_EXHAUSTED is skipped and the next one tried; when none is left: NoInstance if
        nothing was tried, else the last instance's error. `attempted` collects every instance
        asked (the caller releases them all if it is cancelled midway)."""
        tried, err = [], None
        while True:
            try:
                inst = first if first is not None and err is None else \
                    self.pools[role].pick(self.affinity[role].get(session), sticky=sticky, exclude=tried)
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

    async def plan(self, r: Request) -> None:
        """Instances, hits and (auto) the policy's decision into `r`; counted and logged."""
        async def hit(inst) -> int:
            size = (await pools.info(inst)).page_size
            m = await pools.stub(inst).MatchPrefix(cluster_pb2.MatchPrefixRequest(
                page_size=size, page_hashes=chain_hashes(r.prompt, size)), timeout=r.deadline.timeout(30))
            return m.matched_tokens

        asked = r.requested
        try:  # P's and MD's prefix matches at once (one round trip, not two); P's error comes first
            picks = [self.pick("prefill", r.session, hit)]
            if asked != common_pb2.PIPELINE_PD_LOCAL:
                picks.append(self.pick("main", r.session, hit, sticky=True))
            got = await asyncio.gather(*picks, return_exceptions=True)
            for res in got:
                if isinstance(res, BaseException) and not isinstance(res, Exception):
                    raise res  # cancelled
            if isinstance(got[0], Exception):
                raise got[0]
            r.prefill, r.hit_prefill = got[0]
            if len(got) > 1:
                if not isinstance(got[1], Exception):
                    r.main_choice, r.hit_main = got[1]
                elif not isinstance(got[1], pools.NoInstance) or asked != common_pb2.PIPELINE_AUTO:
                    raise got[1]
            if asked != common_pb2.PIPELINE_PD_CROSS:
                r.relay, _ = await self.pick("relay", r.session)
        except pools.NoInstance as e:
            raise Abort(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except grpc.aio.AioRpcError as e:
            raise from_rpc(e, "prefix match") from None
        r.pipeline, n = asked, len(r.prompt)
        try:
            too_small = await self._too_small(r)
        except grpc.aio.AioRpcError as e:
            raise from_rpc(e, "info") from None
        if too_small is not None:  # auto, and one decode tier can never hold this request: the other
            r.pipeline, r.reason = too_small
            r.explain = (f"{PIPELINE_NAMES[r.pipeline]} ({r.reason}): prompt {n} + max_tokens {r.max_tokens} "
                         f"exceed what {'RLD' if r.reason == 'relay-too-small' else 'MD'} can hold per request")
        elif asked == common_pb2.PIPELINE_AUTO and r.main_choice is None:
            r.pipeline, r.reason = common_pb2.PIPELINE_PD_LOCAL, "no-main"
            r.explain = "pd-local (no-main): no healthy MD instance"
        elif asked == common_pb2.PIPELINE_AUTO:
            remaining = r.deadline.remaining()
            if self.probe_on and self.estimates.probe_unmeasured(r.main_choice):
                self.counters["link_probes"] += 1
            await self.estimates.settled(r.main_choice, self.probe_wait_s if remaining is None
                                         else min(self.probe_wait_s, remaining / 2))
            link = self.estimates.link(r.main_choice)
            i = Inputs(prompt_tokens=n, max_tokens=r.max_tokens, hit_prefill=r.hit_prefill, hit_main=r.hit_main,
                       kv_bytes_per_token=round(await self.estimates.wire_bytes_per_token(  # as encoded
                           r.prefill, await self.estimates.wire_format(r.main_choice))),
                       wan_bytes_per_s=link.throughput.value, wan_latency_s=link.latency.value,
                       wan_queue_bytes=link.queued, relay_tokens_per_s=self.estimates.speed(r.relay).value,
                       filtered_share=self.window.share(), session_id=r.session,
                       predicted_output=self.sessions.predicted_output(r.session),
                       session_drift=self.sessions.drift(r.session), wan_source=link.describe())
            d = decide(i, self.policy)
            self.window.add(d.pipeline == PD_LOCAL)
            r.pipeline, r.reason, r.sync_main = PIPELINES[d.pipeline], d.reason, d.sync_main
            r.explain = d.explain(i)
        else:
            r.reason = "requested"
            r.explain = (f"{PIPELINE_NAMES[asked]} (requested): hit P {r.hit_prefill}/{n}"
                         + (f", MD {r.hit_main}/{n}" if r.main_choice else ""))
        self.counters[f"decision.{PIPELINE_NAMES[r.pipeline]}.{r.reason}"] += 1
        if r.main_choice is not None:
            self.sessions.record_hits(r.session, n, r.hit_prefill, r.hit_main)
            self.counters["prompt_tokens"] += n
            self.counters["hit_prefill_tokens"] += r.hit_prefill
            self.counters["hit_main_tokens"] += r.hit_main
        relay = r.relay if r.pipeline != common_pb2.PIPELINE_PD_CROSS else None
        main = r.main_choice if r.pipeline != common_pb2.PIPELINE_PD_LOCAL or r.sync_main else None
        used = [inst for inst in (r.prefill, relay, main) if inst]
        r.explain += " [" + ", ".join(inst.name for inst in used) + "]"  # names: no address reaches users

    async def _too_small(self, r: Request) -> tuple[int, str] | None:
        """Checks the request against the most tokens each chosen tier can ever hold (its whole KV
        pool): a tier the pipeline needs that is too small -> INVALID_ARGUMENT saying so (never a
        retryable RESOURCE_EXHAUSTED); `auto` with one decode tier too small -> (the pipeline
        that avoids it, reason)."""
        need, asked = len(r.prompt) + r.max_tokens, r.requested
        if len(r.prompt) + 1 > await pools.max_sequence_tokens(r.prefill):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"the prompt ({len(r.prompt)} tokens) can never fit P's "
                                                          f"KV pool ({await pools.max_sequence_tokens(r.prefill)} "
                                                          f"tokens per request)")
        relay_ok = r.relay is None or need <= await pools.max_sequence_tokens(r.relay)
        main_ok = r.main_choice is None or need <= await pools.max_sequence_tokens(r.main_choice)
        if asked == common_pb2.PIPELINE_AUTO and relay_ok != main_ok and r.relay and r.main_choice:
            return (common_pb2.PIPELINE_PD_CROSS, "relay-too-small") if main_ok else \
                (common_pb2.PIPELINE_PD_LOCAL, "main-too-small")
        for ok, tier, inst, used in ((relay_ok, "RLD", r.relay, asked != common_pb2.PIPELINE_PD_CROSS),
                                     (main_ok, "MD", r.main_choice, asked != common_pb2.PIPELINE_PD_LOCAL)):
            if not ok and used:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"prompt ({len(r.prompt)} tokens) + max_tokens {r.max_tokens} can never fit {tier}'s KV "
                            f"pool ({await pools.max_sequence_tokens(inst)} tokens per request): ask for fewer tokens")
        return None

    async def reserve(self, r: Request) -> None:
        """Reserve on MD, then RLD; holds the instances used. Raises Abort (UNAVAILABLE: none
        left; the failed Reserve's status otherwise)."""
        async def reserve_on(inst) -> int:
            # a full pool: RLD's queues the request (FIFO, up to its deadline); MD's too, but for
            # `auto`, which serves it pd-local at once instead (main-full)
            wait = inst.role == "relay" or r.requested != common_pb2.PIPELINE_AUTO
            res = await pools.stub(inst).Reserve(cluster_pb2.ReserveRequest(spec=r.spec, use_cache=True,
                                                                            wait_for_pages=wait),
                                                 timeout=r.deadline.timeout())
            r.queued_ms += res.queued_ms
            self.m.page_wait(inst.role, res.queued_ms)
            return res.cached_tokens

        for inst in [r.prefill] + ([r.relay] if r.uses_relay else []):
            r.hold(inst)
        # auto pdd: MD answers at once (it never waits for pages), so RLD's Reserve runs beside it
        # (RLD is served either way: pdd, or pd-local if every MD is full). An explicit pdd keeps
        # MD first: both wait for pages then, and holding RLD while waiting for MD could deadlock.
        relay = asyncio.ensure_future(reserve_on(r.relay)) if (
            r.uses_main and r.uses_relay and r.requested == common_pb2.PIPELINE_AUTO) else None
        if relay is not None:
            relay.add_done_callback(lambda t: t.cancelled() or t.exception())  # read even if MD's error won
        try:
            if r.uses_main:
                try:  # a full or gone MD: the least-loaded other one
                    r.main, r.cached_main = await self.pick("main", r.session, reserve_on, first=r.main_choice,
                                                            attempted=r.main_asked)
                except grpc.aio.AioRpcError as e:
                    if not self._fall_back_local(r, e):
                        raise
                    r.hold(r.relay)
                else:
                    r.hold(r.main)
            if r.uses_relay:  # RLD's own prefix cache (sessions stick to their RLD): P sends only the rest
                r.cached_relay = await (relay or reserve_on(r.relay))
        except pools.NoInstance as e:
            raise Abort(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except grpc.aio.AioRpcError as e:
            raise from_rpc(e, "reserve") from None
        finally:
            if relay is not None and not relay.done():
                relay.cancel()  # failed or cancelled before it was awaited: RLD is released with the rest

    def _fall_back_local(self, r: Request, e: grpc.aio.AioRpcError) -> bool:
        """Every MD is full or gone: an `auto` request that has an RLD is served pd-local instead
        (counted and explained); an explicit pd-cross or pdd keeps the error (-> False)."""
        if r.requested != common_pb2.PIPELINE_AUTO or r.relay is None or e.code() not in _RETRY:
            return False
        why = "main-full" if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "main-unavailable"
        self.counters[f"fallback.pd-local.{why}"] += 1
        r.explain = (f"pd-local ({why}): MD answered {e.code().name} ({e.details()}), so P -> RLD only; "
                     f"the policy had chosen {r.explain}")
        r.pipeline, r.reason, r.sync_main = common_pb2.PIPELINE_PD_LOCAL, why, False
        return True

    def learn(self, r: Request) -> None:
        """After a finished request: RLD's speed, the session's output length and affinity."""
        if r.relay_after >= 4 and r.relay_t1 > r.relay_t0:
            self.estimates.speed(r.relay).add(r.relay_after / (r.relay_t1 - r.relay_t0))
        self.sessions.record_output(r.session, len(r.tokens))
        self.affinity["prefill"].set(r.session, r.prefill.address)
        if r.relay is not None:
            self.affinity["relay"].set(r.session, r.relay.address)
        if r.main is not None or r.sync_main:
            self.affinity["main"].set(r.session, (r.main or r.main_choice).address)
