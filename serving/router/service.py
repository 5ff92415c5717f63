"""The router's gRPC service (router.proto): the user-facing streaming `Generate`, and `Stats`.

`RouterService` composes its collaborators and holds no per-request state: each Generate makes
one `request.Request` and passes it to every stage, moving it through its states
(request_state.State, in capitals below). A request's life (pipeline pdd; the others drop a tier):
  1. VALIDATE (`validate.read`): tokenize (a large prompt on a worker thread), check against the
     model (INVALID_ARGUMENT with one sentence, nothing reserved); the client's deadline becomes
     every downstream RPC's timeout;
  2. ADMISSION (`admission.Admission`): a slot, or a FIFO wait for one; past max_inflight +
     max_queue -> RESOURCE_EXHAUSTED at once;
  3. PLAN (`choose.Chooser.plan`): the least-loaded healthy P and RLD (ties: the session's last
     one), the MD that holds the session's context (affinity; else the least loaded), their
     prefix hits (chained page hashes, no tokens move); auto: `policy.decide` from those hits,
     the KV bytes per token, the link's measured throughput and queue and RLD's measured speed
     (`estimates.Estimates`: probed at the router's start and when an MD rejoins, then
     refreshed by transfers; a request waits up to wan_probe_wait_ms for its MD's first probe),
     the TTFT budget and the session's history: pd-cross, pdd, or pd-local for singular
     traffic (a filtered session turn is synced to MD afterwards); the explanation names the
     link estimate's source and age;
  4. RESERVE (`Chooser.reserve`): MD (pins its DRC prefix -> cached_on_main; a full or gone
     MD: the next; all full or gone: `auto` goes pd-local, reason main-full / main-unavailable),
     then RLD; logged, counted, and the first message (pipeline, explain) sent;
  5. RELAY_STREAMING (pd-cross: MAIN_STREAMING) (`transfer.Transfers.open`): RLD's and MD's
     Decode streams open, P prefills and pushes KV to both at once; RLD streams tokens (relay)
     as soon as its KV lands; when P reports MD's KV delivered, RLD's Handoff (one-shot, or
     chunked above the threshold) ends RLD's stream at handed_off_at = N and MD's starts at N
     (MAIN_STREAMING); `stream.Output` forwards both, in order, into GenerateResponses. A tier
     that fails mid-request: `recovery` (RLD's stream broken: RELAY_LOST, MD takes over);
  6. FINISHED, before the last message (so the client's next turn sees its effects): the request
     stops loading its instances, `Chooser.learn` (RLD speed, output length, affinity), a
     filtered turn's context sync starts in the background;
  7. ENDED (from RESERVE on, also on failure, client cancel or deadline): every task cancelled,
     every tier released (`Transfers.release`, after P's push to MD if the user's stream ended
     first). A request refused before RESERVE stays in its state: it holds nothing.
Metrics (TTFT, ITL, pipelines, handoffs, failures, WAN bytes): `metrics.RouterMetrics`;
`Stats` (to callers on the router's host only): counters, admission, per-MD link estimates, RLD speeds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import sys

import grpc

from serving.config import RouterSettings
from serving.pb import cluster_pb2, router_pb2, router_pb2_grpc
from serving.router import pools, token_bytes, validate
from serving.router.admission import Admission, Deadline, Refused
from serving.router.choose import Chooser
from serving.router.estimates import Estimates
from serving.router.metrics import RouterMetrics
from serving.router.request import PIPELINE_NAMES, Abort, Request
from serving.router.request_state import State
from serving.router.stream import Output, expire
from serving.router.transfer import Transfers

HOLD_RPC_S = 5.0  # each try of RLD's Hold


class RouterRefusal(grpc.aio.AioRpcError):
    """The router's refusal of a request (its status and one sentence), as a gRPC client gets it."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, settings: RouterSettings, model_config, tokenizer):
        s = self.s = settings
        self.cfg, self.tok = model_config, tokenizer
        self._bg: set[asyncio.Task] = set()  # background work (releases, context syncs), kept referenced
        self.pools = {"prefill": pools.Pool("prefill", s.prefill), "relay": pools.Pool("relay", s.relay, s.relay_kv),
                      "main": pools.Pool("main", s.main, s.main_wan)}
        self.counters: collections.Counter = collections.Counter()  # Stats' counters
        self.admission = Admission(s.max_inflight, s.max_queue)  # bounded: RESOURCE_EXHAUSTED past it
        self.m = RouterMetrics(admission=self.admission)
        self.estimates = Estimates(s)
        self.m.watch_links(self.estimates)  # pddjax_router_link_mbps / _latency_seconds per MD
        self.chooser = Chooser(self.pools, s, self.estimates, self.counters, self.m)
        self.transfers = Transfers(s, self.pools["prefill"], self.estimates, self.counters, self.m)

    def attach_metrics(self, metrics) -> None:
        """server.py: the router's metrics join the service's registry (one /metrics endpoint)."""
        self.m.attach(metrics.registry)

    def start(self, loop) -> None:
        for pool in self.pools.values():
            for inst in pool.instances:
                inst.channel = pools.channel(inst.address)
        self._health = loop.create_task(pools.health_loop(list(self.pools.values()), self.s.health_interval_s,
                                                          self.s.health_timeout_s, self.counters, self._on_back))
        for inst in self.pools["main"].instances:  # the links' first measurement, before any request
            self._on_back(inst)
        if self.tok is not None:  # logprobs' exact token bytes, built off the event loop
            self._token_bytes = loop.run_in_executor(None, token_bytes.build, self.tok)

    def _on_back(self, inst: pools.Instance) -> None:
        """An MD at start or back in the rotation: its link is probed again (background)."""
        if inst.role == "main" and self.s.wan_probe and self.estimates.start_probe(inst):
            self.counters["link_probes"] += 1

    async def Stats(self, request, context):
        """The operator's view (every tenant's counters, instance addresses): answered to callers on
        this host only (`pddjax up`, benches, an operator's port-forward); users get PERMISSION_DENIED."""
        peer = context.peer() or ""
        if not peer.startswith(("ipv4:127.", "ipv6:[::1]", "unix:")):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "Stats is answered only on the router's own "
                                                                   "host; use its /metrics endpoint")
        return router_pb2.StatsResponse(json=json.dumps(self.stats()))

    def stats(self) -> dict:
        """Stats' answer as a dict (the co-hosted gateway reads it in process)."""
        return {"model": {"name": self.cfg.name, "max_context": self.cfg.max_context},
                "counters": dict(self.counters), "admission": self.admission.stats(), **self.estimates.stats(),
                "filtered_share": self.chooser.window.share(),
                "instances": [{"role": i.role, "name": i.name, "address": i.address, "healthy": i.healthy,
                               "inflight": i.inflight} for i in self._instances()]}

    def _instances(self) -> list[pools.Instance]:
        return [i for p in self.pools.values() for i in p.instances]

    async def Generate(self, request, context):
        r = Request(deadline=Deadline.of(context, self.s.default_deadline_s, self.s.max_deadline_s))  # bounded
        async with contextlib.aclosing(self._answered(request, r)) as messages:
            try:
                async for msg in messages:
                    yield msg
            except RouterRefusal as e:
                await context.abort(e.code(), e.details())

    def generate_local(self, request: router_pb2.GenerateRequest, timeout_s: float | None = None):
        """The router's in-process entry point (the co-hosted OpenAI gateway's, through
        serving/stack/cohost.py): Generate's stages, metrics and release without gRPC -> an async
        generator of the GenerateResponses themselves (nothing serialized).
        What the gRPC port does around its handler, the caller does, in the same order and words:
        the bearer token first (security.bearer_refusal: UNAUTHENTICATED), then the Gate
        (Gate.refusal: UNAVAILABLE while loading or draining), and the deadline: `timeout_s`
        (None: default_deadline_s; at most max_deadline_s) bounds every downstream RPC and the
        stream as a gRPC client's deadline does, and the caller cancels the generator when it passes
        (as grpc cancels the handler). A refusal raises RouterRefusal (the grpc.aio.AioRpcError a gRPC client gets);
        closing or cancelling the generator is the client's cancel: every tier released, counted
        CANCELLED (DEADLINE_EXCEEDED past the deadline)."""
        return self._answered(request, Request(deadline=Deadline.capped(
            self.s.default_deadline_s if timeout_s is None else timeout_s, self.s.max_deadline_s)))

    async def _answered(self, request: router_pb2.GenerateRequest, r: Request):
        """`_generate` as both entries serve it: a refusal counted and raised as RouterRefusal
        (its text without instance addresses), a cancel or deadline counted, the admission slot
        left however it ends."""
        try:
            async with contextlib.aclosing(self._generate(request, r)) as messages:  # closed now, not at GC
                async for msg in messages:
                    yield msg
        except (Abort, Refused) as e:
            self.m.failed(e.code.name, e.stage or r.stage)
            raise RouterRefusal(e.code, pools.public_text(e.message, self._instances())) from None
        except (asyncio.CancelledError, GeneratorExit):  # the client went away, or its deadline passed
            self.m.failed("DEADLINE_EXCEEDED" if r.deadline.expired(slack_s=0.2) else "CANCELLED", r.stage)
            raise
        finally:
            if r.admitted:
                self.admission.leave()

    async def _generate(self, req: router_pb2.GenerateRequest, r: Request):
        await validate.read(r, req, self.cfg, self.tok, self.s.handoff, self.s.tool_parser,
                            (int(self.s.stream_interval), float(self.s.stream_interval_ms)))
        r.interval_at_source = self.s.interval_at_source and r.stream_interval[0] > 1
        r.advance(State.ADMISSION)
        await self.admission.enter(r.deadline)  # Refused (RESOURCE_EXHAUSTED) past max_inflight + max_queue
        r.advance(State.PLAN)  # holds the admission slot (`r.admitted`)
        await self.chooser.plan(r)
        expiry = None
        r.advance(State.RESERVE)  # from here on `_end` moves it to ENDED however it ends
        try:
            await self.chooser.reserve(r)
            await self.transfers.choose_wire(r)  # each target's KV wire format, named in explain
            self.m.chosen(PIPELINE_NAMES[r.pipeline], r.reason)
            r.explain = pools.public_text(r.explain, self._instances())  # e.g. MD's Reserve error in it
            where = " ".join(f"{i.name}={i.address}" for i in (r.prefill, r.relay, r.main or r.main_choice) if i)
            print(f"router: {r.label} ({r.rid}) session={r.session or '-'} {r.explain} ({where})", file=sys.stderr,
                  flush=True)
            yield router_pb2.GenerateResponse(request_id=r.label, pipeline=r.pipeline, prompt_token_ids=r.prompt,
                                              explain=r.explain)
            r.advance(State.RELAY_STREAMING if r.uses_relay else State.MAIN_STREAMING)
            if r.deadline.remaining() is not None:  # the stream stops at the deadline even if no tier reports it
                expiry = asyncio.get_running_loop().call_later(r.deadline.remaining(), expire, r.relay_out, r.main_out)
            await self.transfers.open(r)
            out = Output(r, self.tok, req.stop_strings, self.m, lambda: self._relay_done(r),
                         lambda hold: _hold_relay(r, hold), lambda: self.transfers.stop_handoff(r))
            async for msg in out.messages():
                if msg.finish_reason:
                    self._settle(r)
                yield msg
        finally:
            if expiry is not None:
                expiry.cancel()
            self._end(r)

    def _relay_done(self, r: Request) -> None:
        """The stream moved to MD: RLD (decoding on until now) stops and frees the request."""
        self.transfers.learn_handoff(r, switched=True)
        if r.relay_pump is not None:
            r.relay_pump.cancel()
        if r.relay is not None:
            self._spawn(_release_relay(r))

    def _settle(self, r: Request) -> None:
        """The user's stream is about to get its last message: this request's effects land first."""
        r.advance(State.FINISHED)  # no longer loads its instances
        name = PIPELINE_NAMES[r.pipeline]
        self.counters[f"requests.{name}"] += 1
        self.m.done(name)
        self.chooser.learn(r)
        if r.handoff_at is None:
            self.transfers.learn_handoff(r, switched=False)
        r.check_integrity()
        if r.sync_main and len(r.prompt) + len(r.tokens) > 1:
            self._spawn(self.transfers.sync_main(r))

    def _end(self, r: Request) -> None:
        """Cancels the request's tasks and releases every tier in the background. RLD finished
        before MD held the KV (pdd): P's push goes on so MD's DRC still gets the context (the
        drift-loop guard), and the release waits for it."""
        push, finished = r.prefill_task, r.state is State.FINISHED
        complete = finished and r.main is not None and push is not None and not push.done()
        for t in r.tasks:
            if not (complete and t is push):
                t.cancel()
        r.advance(State.ENDED)
        if not finished:
            self.counters["requests.failed"] += 1
        if complete:
            self.counters["main_completed_in_background"] += 1
        self._spawn(self.transfers.release(r, push if complete else None))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)


async def _hold_relay(r: Request, hold: bool) -> None:
    """RLD pauses (`hold`) or resumes the request while the user waits for MD (serving/engine/hold.py).
    A pause that fails leaves RLD decoding (it only saves RLD's work); a resume is retried while
    RLD is unreachable, since a request left paused would stall (a lost RLD ends its stream anyway)."""
    req = cluster_pb2.HoldRequest(request_id=r.rid, hold=hold)
    for wait in (0.1, 0.3, 1.0, None) if not hold else (None,):
        try:
            await pools.stub(r.relay).Hold(req, timeout=HOLD_RPC_S)
            return
        except grpc.aio.AioRpcError as e:
            if wait is None or e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return
        await asyncio.sleep(wait)


async def _release_relay(r: Request) -> None:
    """RLD's release at the switch, in the background; once answered the request's final release
    skips RLD (it retries it otherwise)."""
    try:
        await pools.stub(r.relay).Release(cluster_pb2.ReleaseRequest(request_id=r.rid, cancel=True))
        r.freed.append(r.relay)
    except grpc.aio.AioRpcError:
        pass
