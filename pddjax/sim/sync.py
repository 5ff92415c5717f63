"""A filtered (P-RLD) turn's context pushed to MD afterwards, one at a time (the drift guard).

pddjax's router (`_sync_main`): once a singular request has finished on RLD, P prefills its
context (prompt + output but the last token; P already holds the prompt, so it computes the
output) and pushes the part MD's DRC lacks over the WAN; MD caches it, so the session's next
turn hits MD. Syncs run one at a time, after the user's request (low priority).
"""

from __future__ import annotations

from pddjax.sim.events import OneAtATime
from pddjax.sim.request import SimRequest
from pddjax.sim.streams import KVStream


class MainSync:
    def __init__(self, cluster, router):
        self.c, self.router = cluster, router
        self._queue = OneAtATime(self._start)
        self.done = 0

    def push(self, req: SimRequest) -> None:
        self._queue.push(req)

    def _start(self, req: SimRequest, done) -> None:
        c = self.c
        sync = SimRequest(req.tr)
        sync.prompt, sync.sync = req.prompt + req.output - 1, True
        md = sync.md_inst = req.md_inst
        md_hit = c.page_floor(c.lineage.cached_hit(md.cache, req)) if c.cfg.drc else 0

        def landed(s: SimRequest) -> None:
            c.cache_on_md(s, s.md_inst, s.prompt)
            self.done += 1
            done()

        stream = KVStream(c, sync, md, c.wan, md_hit, landed, estimator=self.router.links[md.name])
        sync.streams, sync.transfer = [stream], stream
        req.p_inst.submit(sync, md_hit, hit=c.page_floor(min(req.prompt, sync.prompt - 1)))
