"""P-RLD-MD: dual-path send, RLD eager decode, and the token-id handoff to MD.

1. P sends the full KV to RLD over RDMA and the delta MD lacks over the WAN, at once.
2. RLD decodes as soon as its KV lands (the user's first token comes from here).
3. When MD holds the KV (and has admitted the sequence), it tells RLD ("ready", B -> A).
4. RLD looks at its pending tokens (generated but not yet handed over):
   - one-shot, or pending <= chunk_threshold: send all pending ids, release RLD at once;
   - chunked and pending > threshold: send them as a chunk and keep decoding; MD runs an
     extend-decode pass over the chunk and acks (B -> A); RLD then sends what it produced
     meanwhile, and so on until a chunk is small enough to be the last.
5. MD's extend pass over the last chunk yields the next token; MD decodes the rest.
If RLD emits the whole output before the handoff completes (a singular request the filter
did not predict), the request finishes on RLD; the WAN push is cancelled
(`cancel_late_transfers`) or, as pddjax's router does, completes in the background and MD
caches the prompt. If MD is
ready before RLD even started (RLD queue full), RLD drops the request and MD serves all of it. Token ids
cost 4 bytes each on the wire, counted in `id_bytes`.
"""

from __future__ import annotations

from pddjax.sim.decode import Seq
from pddjax.sim.request import SimRequest

ID_BYTES = 4


class Handoff:
    def __init__(self, cluster):
        """`cluster`: the `cluster.Cluster` that builds this handoff (handed in, not imported:
        cluster.py imports this module)."""
        self.c = cluster
        self.id_bytes = 0
        self.cancelled_transfers = 0

    def prepare(self, req: SimRequest) -> None:
        """The two sequences of a P-RLD-MD request (the router streams P's KV to both)."""
        c = self.c
        req.rld_seq = Seq(req, req.prompt + req.output, req.prompt, req.output - 1, True,
                          on_admit=lambda s: setattr(req, "first_token", c.loop.now),
                          on_finish=lambda s: self._rld_finished(req))
        md = req.md_inst
        req.md_seq = Seq(req, req.prompt + req.output - req.md_pinned, req.prompt, 0, False,
                         on_admit=lambda s: c.back.message(lambda: self._step(req)),
                         on_finish=lambda s: c.finish_on(req, md, c.user_lag))
        req.md_seq.reserved = req.md_pinned

    def rld_landed(self, req: SimRequest) -> None:
        """RLD holds the full KV: it starts decoding (its first token is the user's)."""
        if req.rld_seq.state == "new":
            req.rld_inst.enqueue(req.rld_seq)

    def kv_at_md(self, req: SimRequest) -> None:
        """MD holds the delta. If RLD already finished (the push was not cancelled), MD
        caches the prompt, as pddjax's router lets the push complete in the background."""
        if req.done:
            if req.md_seq.state == "new":
                req.kv_at_md = True
                self.c.cache_on_md(req, req.md_inst, req.prompt)
            return
        req.kv_at_md = True
        req.md_inst.enqueue(req.md_seq)

    def _step(self, req: SimRequest) -> None:
        """RLD side: MD is ready for (more) tokens."""
        c, cfg = self.c, self.c.cfg
        rld, seq = req.rld_inst, req.rld_seq
        if req.done or seq.state == "done":
            return
        if req.handoff_start < 0:
            req.handoff_start = c.loop.now
        if seq.state in ("new", "waiting"):  # RLD never started: MD serves the whole request
            rld.remove(seq)
            req.rld_tokens = 0
            c.wan.message(lambda: self._take_over(req, from_start=True))
            return
        pending = rld.progress(seq) - req.handed
        final = cfg.handoff == "oneshot" or pending <= cfg.chunk_threshold
        if final:
            emitted = rld.remove(seq)
            req.rld_last = c.loop.now
            c.cache_on_rld(req, req.prompt + emitted)
            if emitted >= req.output:  # RLD already produced everything
                self._rld_finished(req, emitted)
                return
            pending = emitted - req.handed
            req.rld_tokens = emitted
        ctx = req.prompt + req.handed
        req.handed += pending
        req.chunks += 1
        self.id_bytes += ID_BYTES * pending
        c.wan.message(lambda: self._extend(req, pending, ctx, final))

    def _extend(self, req: SimRequest, k: int, ctx: int, final: bool) -> None:
        """MD side: the chunk's ids arrived."""
        c = self.c
        if req.done or req.md_seq.state == "done":
            return

        def done() -> None:
            if final:
                self._take_over(req)
            else:
                c.back.message(lambda: self._step(req))

        if k == 0:
            done()
        else:
            req.md_inst.extend(req.md_seq, k, ctx, done)

    def _take_over(self, req: SimRequest, from_start: bool = False) -> None:
        """MD's pass over the last chunk produced token handed+1; MD decodes the rest. With
        `from_start` RLD never began, and MD emits the prefill's token itself."""
        if req.done or req.md_seq.state == "done":
            return
        req.handoff_end = self.c.loop.now
        if from_start:
            req.first_token = self.c.loop.now + self.c.user_lag
        remaining = req.output - req.handed - 1
        req.md_inst.start_decoding(req.md_seq, req.handed + 1, remaining, req.prompt + req.handed + 1)

    def _rld_finished(self, req: SimRequest, emitted: int | None = None) -> None:
        """RLD emitted the last token before MD took over: finish here, cancel the WAN side."""
        c = self.c
        req.finish = req.rld_last = c.loop.now
        req.rld_tokens, req.md_tokens = req.output, 0
        c.cache_on_rld(req, req.prompt + req.output)
        req.pipeline = "P-RLD*"  # dual path started, finished on RLD
        md, mseq = req.md_inst, req.md_seq
        if c.cfg.cancel_late_transfers and req.transfer is not None and not req.transfer.landed:
            req.transfer.cancel()
            req.wan_bytes = req.transfer.bytes_sent
            self.cancelled_transfers += 1
        if mseq.state in ("waiting", "admitted", "running"):
            md.remove(mseq)
        elif mseq.state == "new" and mseq.reserved:  # KV never arrived: give the pin back
            mseq.reserved = 0
            c.unpin(req)
        if req.kv_at_md:
            c.cache_on_md(req, md, req.prompt)
        c.complete(req)
