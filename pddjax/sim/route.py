"""The router: placement, the pipeline decision, and the KV streams from P to the decode tiers.

At send time (what pddjax's router does in `_plan`):
- P: the instance with the earliest predicted finish (cache-aware load balancing).
- MD / D: the instance with the largest DRC hit among those whose load is within
  `LOAD_SLACK` of the least loaded one (session affinity unless it would pile up).
- pipeline: pd-local -> P-D, pd-cross -> P-MD; pdd -> `pddjax.policy.decide`, the
  real router's decision, fed the same estimates it keeps: the link's throughput and latency
  measured from completed transfers (`LinkEstimator`, timed from P's admission to MD's
  acknowledgement, as P's push is), RLD's measured decode speed, the session's output
  history and hit drift, and the filtered share of recent decisions. pd-cross -> P-MD,
  pdd -> P-RLD-MD, pd-local (singular) -> P-RLD, whose context is then pushed to MD in the
  background, one session at a time (`sync.py`). The drift experiment (`rld_normal_path`)
  sends every would-be P-RLD-MD request P-RLD without that push.
Then P streams the KV: to a tier in A (RLD, local D) over the fast link, from token 0 (cluster
scale: the report's RDMA copy) or, on an engine host, from the tier's own prefix-cache hit
(pddjax's Reserve on RLD: sessions stick to their RLD, which caches what it served); to MD
from its DRC hit over the WAN; MD's DRC entry is pinned until the request is done with it.

On an engine host the router's RPCs are modelled too, one after the other as `_plan` and
`_generate` make them: MatchPrefix on P (and on MD unless pd-local), the decision, Reserve on
MD and / or RLD (or local D), then P's Prefill, whose admission starts the prefill. Each RPC
runs on the engine's thread between steps (`worker.call`), so it waits for the step in
flight: a request reaches P's batch only after P has finished a step it did not start with.
"""

from __future__ import annotations

from pddjax.policy import (
    PD_CROSS,
    PD_LOCAL,
    Ewma,
    FilterWindow,
    Inputs,
    LinkEstimator,
    PolicyConfig,
    SessionTracker,
    decide,
)
from pddjax.sim.request import SimRequest
from pddjax.sim.streams import KVStream
from pddjax.sim.sync import MainSync

LOAD_SLACK = 0.25  # fraction of max_batch an affine instance may exceed the least loaded by
PIPELINE = {PD_CROSS: "P-MD", PD_LOCAL: "P-RLD"}  # else P-RLD-MD


class Router:
    def __init__(self, cluster):
        """`cluster`: the `cluster.Cluster` that builds this router (handed in, not imported:
        cluster.py imports this module)."""
        c = self.c = cluster
        cfg = c.cfg
        self.counts: dict[str, int] = {}
        self.reasons: dict[str, int] = {}
        self.policy = PolicyConfig(ttft_budget_s=cfg.rld_threshold_s, filter_cap=cfg.filter_cap,
                                   filter_window=cfg.filter_window, drift_tolerance=cfg.drift_tolerance,
                                   handoff_threshold=cfg.chunk_threshold)
        self.restart()
        self.sync = MainSync(c, self)

    def restart(self) -> None:
        """Fresh estimates (what a restarted router process knows): the link priors, RLD's
        speed prior, no session history, an empty filter window. `bench serve` restarts the
        router after the history phase; the caches of P, RLD and MD stay warm."""
        c, cfg = self.c, self.c.cfg
        mbps = 1e3 * (cfg.wan_prior_gbps or cfg.wan_gbps)
        self.links = {d.name: LinkEstimator(mbps, cfg.wan_latency_s) for d in c.D}
        ctx = c.mean_context
        prior = cfg.rld_prior_tokens_per_s or (1.0 / c.R[0].perf.step_s(1, ctx) if c.R else 1.0)
        self.rld_speed = {r.name: Ewma(prior) for r in c.R}
        self.sessions = SessionTracker()
        self.window = FilterWindow(cfg.filter_window)

    # ---- placement and decision -----------------------------------------------------------
    def admit(self, req: SimRequest) -> None:
        """Pick instances, ask P (and MD) for their hits, decide, reserve, prefill."""
        c, cfg = self.c, self.c.cfg
        p = min(c.P, key=lambda inst: inst.predict_s(req))
        md = self._pick_decode(req)
        req.md_inst = md
        matches = [p] if cfg.mode == "pd-local" else [p, md]
        self._rpcs(matches, lambda: self._plan(req, p))

    def _rpcs(self, insts: list, then) -> None:
        """RPCs to `insts` one after the other (each waits for its engine thread), then `then`."""
        if not insts:
            then()
            return
        rpc_s = self.c.cfg.host.rpc_s if self.c.cfg.host else 0.0
        head, rest = insts[0], insts[1:]

        def call():
            head.run_command(0.0, lambda: self._rpcs(rest, then))

        if rpc_s > 0:
            self.c.loop.after(rpc_s, call)
        else:
            call()

    def _plan(self, req: SimRequest, p) -> None:
        c, cfg = self.c, self.c.cfg
        md = req.md_inst
        req.md_hit = c.page_floor(c.lineage.cached_hit(md.cache, req)) if cfg.drc else 0
        md.cache.touch(("d", req.doc))
        if cfg.mode == "pd-local":
            pipeline = "P-D"
        elif cfg.mode == "pd-cross":
            pipeline = "P-MD"
        else:
            pipeline = self._decide(req, p)
            if pipeline in ("P-MD", "P-RLD-MD") and not self._md_holds(req, md):
                pipeline, req.sync_main = "P-RLD", False  # Reserve on MD: RESOURCE_EXHAUSTED -> pd-local
                self.reasons["main-full"] = self.reasons.get("main-full", 0) + 1
        self._count(pipeline)
        req.pipeline = pipeline
        uses_md = pipeline in ("P-D", "P-MD", "P-RLD-MD")
        d_start = (c.own_hit(req, md) if cfg.host else req.md_hit) if pipeline == "P-D" else 0  # before the pin
        if uses_md and cfg.drc:
            entry = md.cache.take(("s", req.sid))
            if entry is not None:
                req.md_pinned, req.md_pinned_turn = entry.tokens, entry.turn
        streams = []
        if pipeline in ("P-RLD", "P-RLD-MD"):
            req.rld_inst = min(c.R, key=lambda r: r.load())
            start = c.own_hit(req, req.rld_inst) if cfg.host else 0  # RLD's prefix cache (Reserve)
            streams.append(KVStream(c, req, req.rld_inst, c.fast[c.P.index(p)], start, self._rld_landed))
        if pipeline == "P-D":
            streams.append(KVStream(c, req, md, c.fast[c.P.index(p)], d_start, self._direct_landed))
        if pipeline in ("P-MD", "P-RLD-MD") and cfg.host:
            req.md_committed = req.prompt + req.output - req.md_hit
            md.committed += req.md_committed
        if pipeline in ("P-MD", "P-RLD-MD"):
            stream = KVStream(c, req, md, c.wan, req.md_hit, self._md_landed, estimator=self.links[md.name])
            streams.append(stream)
            req.transfer = stream
            req.wan_bytes = (req.prompt - req.md_hit) * c.kvb
        if pipeline == "P-RLD-MD":
            c.handoff.prepare(req)
        req.streams = streams
        reserves = ([md] if uses_md else []) + ([req.rld_inst] if req.rld_inst is not None else [])
        self._rpcs(reserves + [p], lambda: self._prefill(req, p))

    def _prefill(self, req: SimRequest, p) -> None:
        for s in req.streams:
            s.t0 = self.c.loop.now  # P's push starts at its admission (first_byte: reset when it sends)
        p.submit(req, min(s.start for s in req.streams))

    def _md_holds(self, req: SimRequest, md) -> bool:
        """On an engine host, MD's Reserve allocates the sequence's pages at once (prompt +
        max tokens, less its DRC hit) and fails when its pool cannot hold them: pages of
        requests whose KV is still crossing the WAN (`committed`) count as taken."""
        if not self.c.cfg.host:
            return True
        return md.cache.can_reserve(md.committed + req.prompt + req.output - req.md_hit)

    def _uncommit(self, req: SimRequest) -> None:
        req.md_inst.committed -= req.md_committed
        req.md_committed = 0

    def _pick_decode(self, req: SimRequest):
        c = self.c
        least = min(d.load() for d in c.D)
        slack = max(1, int(LOAD_SLACK * c.D[0].max_batch))
        best, best_key = None, None
        for d in c.D:
            hit = c.lineage.cached_hit(d.cache, req) if c.cfg.drc else 0
            if d.load() > least + slack:
                hit = -1
            key = (hit, -d.load())
            if best_key is None or key > best_key:
                best, best_key = d, key
        return best

    def _decide(self, req: SimRequest, p) -> str:
        c, cfg = self.c, self.c.cfg
        rld = min(c.R, key=lambda r: r.load())
        link = self.links[req.md_inst.name]
        sid = str(req.sid)
        hit_p = p.hit_for(req)
        i = Inputs(prompt_tokens=req.prompt, max_tokens=req.output, hit_prefill=hit_p, hit_main=req.md_hit,
                   kv_bytes_per_token=int(c.kvb), wan_bytes_per_s=link.throughput.value,
                   wan_latency_s=link.latency.value, wan_queue_bytes=link.queued,
                   relay_tokens_per_s=self.rld_speed[rld.name].value, filtered_share=self.window.share(),
                   session_id=sid, predicted_output=self.sessions.predicted_output(sid),
                   session_drift=self.sessions.drift(sid))
        d = decide(i, self.policy)
        self.window.add(d.pipeline == PD_LOCAL)
        self.sessions.record_hits(sid, req.prompt, hit_p, req.md_hit)
        self.reasons[d.reason] = self.reasons.get(d.reason, 0) + 1
        pipeline = PIPELINE.get(d.pipeline, "P-RLD-MD")
        if pipeline == "P-RLD-MD" and cfg.rld_normal_path:
            return "P-RLD"  # drift experiment: RLD's result never reaches MD
        req.sync_main = d.sync_main and not cfg.rld_normal_path
        return pipeline

    # ---- KV landed at a decode tier -------------------------------------------------------
    def _direct_landed(self, req: SimRequest) -> None:
        c = self.c
        seq = c.direct_seq(req, req.md_inst, in_b=False, pinned=req.md_pinned)
        req.md_seq = seq
        req.kv_at_md = True
        req.md_inst.enqueue(seq)

    def _md_landed(self, req: SimRequest) -> None:
        c = self.c
        self._uncommit(req)  # the sequence now waits for admission in MD's own accounting
        if req.pipeline == "P-MD":
            seq = c.direct_seq(req, req.md_inst, in_b=True, pinned=req.md_pinned)
            req.md_seq = seq
            req.kv_at_md = True
            req.md_inst.enqueue(seq)
        else:
            c.handoff.kv_at_md(req)

    def _rld_landed(self, req: SimRequest) -> None:
        c = self.c
        if req.pipeline == "P-RLD":
            seq = c.direct_seq(req, req.rld_inst, in_b=False)
            req.rld_seq = seq
            req.rld_inst.enqueue(seq)
        else:
            c.handoff.rld_landed(req)

    # ---- P callbacks ------------------------------------------------------------------------
    def on_chunk(self, req: SimRequest, a: int, b: int, last: bool) -> None:
        for s in req.streams:
            s.chunk(a, b, last)

    def prefilled(self, req: SimRequest) -> None:
        if not getattr(req.p_inst, "streams", False):  # a whole-prompt P: everything at once
            self.on_chunk(req, 0, req.prompt, True)

    # ---- after a request --------------------------------------------------------------------
    def finished(self, req: SimRequest) -> None:
        sid = str(req.sid)
        self.sessions.record_output(sid, req.output)
        relay_after = req.rld_tokens - 1
        if req.rld_inst is not None and relay_after >= 4 and req.rld_last > req.first_token:
            self.rld_speed[req.rld_inst.name].add(relay_after / (req.rld_last - req.first_token))
        if req.sync_main:
            self.sync.push(req)

    def _count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1
