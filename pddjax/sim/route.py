"""The router: where a request prefills, which decode instance gets it, and which pipeline.

Placement (at send time):
- P: the instance with the earliest predicted finish, queue wait + prefill time given that
  instance's cache hit (cache-aware load balancing).
- MD / D: the instance with the largest DRC hit among those whose load is within
  `LOAD_SLACK` of the least loaded one (session affinity unless it would pile up). The
  session's DRC entry there is pinned (reserved) until the request is done with it.

Pipeline (after prefill, PDD mode only): with delta = (prompt - DRC hit) * KV bytes/token and
T = the line's predicted delivery time for delta bytes,
- T <= rld_threshold_s                          -> P-MD
- rld_normal_path (drift experiment)            -> P-RLD (MD never receives this context)
- singular_filter and (output-1) * RLD TPOT <= T -> P-RLD (RLD would finish first)
- otherwise                                      -> P-RLD-MD (dual-path send, then handoff)
The singular filter also acts reactively: if RLD finishes before the handoff completes, the
WAN transfer is cancelled (`handoff.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pddjax.sim.request import SimRequest

if TYPE_CHECKING:
    from pddjax.sim.cluster import Cluster

LOAD_SLACK = 0.25  # fraction of max_batch an affine instance may exceed the least loaded by


class Router:
    def __init__(self, cluster: "Cluster"):
        self.c = cluster
        self.counts: dict[str, int] = {}

    # ---- placement ---------------------------------------------------------------------
    def admit(self, req: SimRequest) -> None:
        c = self.c
        p = min(c.P, key=lambda inst: inst.predict_s(req))
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
        req.md_inst = best
        if c.cfg.drc:
            req.md_hit = c.lineage.cached_hit(best.cache, req)
            entry = best.cache.take(("s", req.sid))
            if entry is not None:
                req.md_pinned, req.md_pinned_turn = entry.tokens, entry.turn
            best.cache.touch(("d", req.doc))
        p.submit(req)

    # ---- pipeline choice -----------------------------------------------------------------
    def route(self, req: SimRequest) -> None:
        c, cfg = self.c, self.c.cfg
        nbytes = (req.prompt - req.md_hit) * c.kvb
        link = c.fast[c.P.index(req.p_inst)]
        if cfg.mode == "pd-local":
            self._direct(req, "P-D", link, nbytes, in_b=False)
            return
        if cfg.mode == "pd-cross":
            self._direct(req, "P-MD", c.wan, nbytes, in_b=True)
            return
        predicted = c.wan.predict_s(nbytes)
        if predicted <= cfg.rld_threshold_s:
            self._direct(req, "P-MD", c.wan, nbytes, in_b=True)
            return
        rld = min(c.R, key=lambda r: r.load())
        tpot = rld.step_estimate(req.prompt)
        if cfg.rld_normal_path or (cfg.singular_filter and (req.output - 1) * tpot <= predicted):
            c.unpin(req)
            req.rld_inst = rld
            self._count("P-RLD")
            req.pipeline = "P-RLD"
            seq = c.direct_seq(req, rld, in_b=False)
            link.send(req.prompt * c.kvb, lambda: rld.enqueue(seq))
            return
        self._count("P-RLD-MD")
        req.pipeline = "P-RLD-MD"
        c.handoff.start(req, rld, link, nbytes)

    def _direct(self, req: SimRequest, name: str, link, nbytes: float, in_b: bool) -> None:
        c = self.c
        self._count(name)
        req.pipeline = name
        inst = req.md_inst
        seq = c.direct_seq(req, inst, in_b=in_b, pinned=req.md_pinned)
        req.md_seq = seq

        def arrived():
            req.kv_at_md = True
            inst.enqueue(seq)

        req.transfer = link.send(nbytes, arrived)
        if link is c.wan:
            req.wan_bytes = nbytes

    def _count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1
