"""One target of P's KV: the tokens from `start` on, streamed as P produces them.

pddjax's P exports each step's KV and pushes it to every target at once (serving/engine/prefill.py):
- on P's asyncio thread each piece is cut into KVChunks of `chunk_bytes` (45 tokens of
  SmolLM2-135M f32 KV at 2 MiB) and serialized (host: `serialize_s_per_token`);
- over the link: a tier in A (RLD, local D) over loopback, MD over the WAN (a stream on the
  line: it shares the bandwidth only while it has bytes to send);
- the receiver's PushKV handler reads chunks as they come and coalesces imports: a chunk
  that arrives while no import is in flight is imported at once (one `worker.call` on the
  engine thread, `import_s_per_token`, so it waits for the step in flight); the chunks that
  arrive meanwhile are imported together by the next call, issued when a later chunk arrives
  and the previous call is done. After the last chunk: wait for the call in flight, import
  what is left, then one more call appends P's first token and starts the sequence
  (`_kv_complete`). Modelled chunk by chunk for a tier in A (a P step's chunks arrive at once);
  for MD, whose chunks are spaced out by the line, the earlier chunks are imported while the
  line delivers, so only the last P step's piece and the completing call are charged;
- then the KV has landed: `on_landed(req)`. For MD, the push's duration to MD's
  acknowledgement (one B -> A delay later) feeds the router's `LinkEstimator`, timed as
  `link_timing` says: "admission" (from P's admission, so P's queue and the prefill count),
  "first_byte", or "wire" (pddjax's TransferDone.wire_ms: the push's time less the time its
  sender waited on P's prefill, i.e. had handed everything P exported to the transport; on
  a FIFO line the transport takes more once the push has fewer than `push_window_bytes`
  unacknowledged, estimated from the line's backlog when the piece was queued).
Without a host (cluster scale) chunks, imports and calls cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable


class KVStream:
    def __init__(self, cluster, req, inst, link, start: int, on_landed: Callable, estimator=None):
        self.c, self.req, self.inst, self.link, self.start = cluster, req, inst, link, start
        self.on_landed, self.estimator = on_landed, estimator
        self.wan = link is cluster.wan
        self.hc = cluster.cfg.host
        self.tokens, self.tr = 0, None
        self.cancelled = self.landed = self.final = False
        self.t0 = cluster.loop.now
        self.planned = int(max(0, req.prompt - start) * cluster.kvb)
        if estimator is not None:
            estimator.start(self.planned)
        self.chunk_tokens = max(1, int(self.hc.chunk_bytes // cluster.kvb)) if self.hc else 0
        self._batch = 0  # tokens received, not yet handed to the engine thread
        self._importing = False  # an import call in flight
        self._finishing = False  # the last chunk arrived: drain, then complete
        self._last_piece = 0  # tokens of the latest piece sent (MD: imported after the line)
        self.waited = 0.0  # seconds the push waited on P's prefill (wire timing)
        self._free_at = self.t0  # when the transport could take more (wire timing)

    def chunk(self, a: int, b: int, last: bool) -> None:
        """P exported tokens [a, b) (`last`: the prompt's final piece)."""
        n = max(0, b - max(a, self.start))
        if self.cancelled or (n == 0 and not last):
            return
        self.tokens += n
        work = self.hc.serialize_s_per_token * n if self.hc else 0.0
        self.c.serializer(self.req.p_inst).run(work, lambda: self._send(n, last))

    def _send(self, n: int, last: bool) -> None:
        if self.cancelled:
            return
        now = self.c.loop.now
        self.waited += max(0.0, now - max(self._free_at, self.t0))  # the push had nothing to send
        if self.hc and not self.wan:  # loopback: the chunks reach the receiver's PushKV at once
            ct = self.chunk_tokens
            pieces = [ct] * (n // ct) + [n % ct] * (n % ct > 0)
            for k in pieces:
                self._arrive(k)
            if last:
                self._finishing = True
                self._settle()
            self._free_at = now
            return
        if self.tr is None:
            self.tr = self.link.open(self._delivered)
            if self.c.cfg.link_timing == "first_byte":
                self.t0 = now
        self._last_piece = n if n else self._last_piece
        self.link.feed(self.tr, n * self.c.kvb, last)
        if self.c.cfg.link_timing == "wire":
            window = self.hc.push_window_bytes if self.hc else 0.0
            self._free_at = now + max(0.0, (self.link.backlog_bytes() - window) / self.link.bw)

    # ---- the receiver's PushKV (a tier in A) ------------------------------------------------
    def _arrive(self, tokens: int) -> None:
        self._batch += tokens
        if not self._importing:
            self._import()

    def _import(self) -> None:
        self._importing = True
        n, self._batch = self._batch, 0
        self.inst.run_command(self.hc.import_s_per_token * n, self._imported)

    def _imported(self) -> None:
        self._importing = False
        if self._finishing:
            self.c.loop.after(0.0, self._settle)  # the handler's next call arrives while the engine steps

    def _settle(self) -> None:
        """After the last chunk: wait for the import in flight, import the rest, complete."""
        if self._importing or self.cancelled or self.landed:
            return
        if self._batch:
            self._import()
        else:
            self._importing = True
            self.inst.run_command(0.0, self._landed)

    # ---- MD over the WAN ----------------------------------------------------------------------
    def _delivered(self) -> None:
        if self.hc is None:
            self._landed()
            return

        def complete():
            self.c.loop.after(0.0, lambda: self.inst.run_command(0.0, self._landed))

        self.inst.run_command(self.hc.import_s_per_token * self._last_piece, complete)

    def _landed(self) -> None:
        if self.cancelled:
            return
        self.landed = True
        self._acknowledged()
        if self.estimator is not None:
            nbytes = int(self.tokens * self.c.kvb)
            waited = self.waited if self.c.cfg.link_timing == "wire" else 0.0
            self.c.back.message(lambda: self.estimator.done(self.planned, nbytes, self.c.loop.now - self.t0 - waited))
        self.on_landed(self.req)

    def _acknowledged(self) -> None:
        """P learns the push is over (its TransferDone): it may free the prompt's pages."""
        done = getattr(self.req.p_inst, "push_done", None)
        if done is not None:
            done(self.req)

    @property
    def bytes_sent(self) -> float:
        return self.tr.sent if (self.tr is not None and self.tr.cancelled) else self.tokens * self.c.kvb

    def cancel(self) -> None:
        """Stop the push (RLD finished first and late transfers are cancelled)."""
        if self.cancelled or self.landed:
            return
        self.cancelled = True
        self._acknowledged()
        if self.tr is not None and not self.tr.done:
            self.link.cancel(self.tr)
        if self.estimator is not None:
            self.estimator.done(self.planned, 0, 0.0, ok=False)
