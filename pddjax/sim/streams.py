"""One target of P's KV: the tokens from `start` on, streamed as P produces them.

pddjax's P exports each step's KV and pushes it to every target at once (prefill_service.py):
- on P's asyncio thread each piece is cut into KVChunks of `chunk_bytes` (45 tokens of
  SmolLM2-135M f32 KV at 2 MiB) and serialized (host: `serialize_s_per_token`);
- over the link: a tier in A (RLD, local D) over loopback, MD over the WAN (a stream on the
  line: it shares the bandwidth only while it has bytes to send);
- the receiver's PushKV handler imports chunk after chunk, each a `worker.call` on its engine
  thread (`import_s_per_token`), and asks for the next only when the last is done, so while
  the receiver is decoding every chunk waits for a step in flight; after the last chunk one
  more call appends P's first token and starts the sequence (`_kv_complete`). Modelled per
  chunk for a tier in A (its chunks arrive at once); for MD, whose chunks are spaced out by
  the line, only the last import and the completing call are on the critical path;
- then the KV has landed: `on_landed(req)`. For MD, the push's duration to MD's
  acknowledgement (one B -> A delay later) feeds the router's `LinkEstimator`: from P's
  admission as P's `TransferDone` times it (`link_timing="admission"`, so P's queue and the
  prefill count as transfer time), or from the first byte sent (`"first_byte"`).
Without a host (cluster scale) chunks, imports and calls cost nothing.
"""

from __future__ import annotations

from collections import deque
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
        self._imports: deque[int] = deque()  # chunk sizes waiting to be imported (a tier in A)
        self._importing = False

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
        if self.hc and not self.wan:  # loopback: the chunks reach the receiver's PushKV at once
            while n > 0:
                self._imports.append(min(n, self.chunk_tokens))
                n -= self._imports[-1]
            self.final = last
            self._pump()
            return
        if self.tr is None:
            self.tr = self.link.open(self._delivered)
            if self.c.cfg.link_timing == "first_byte":
                self.t0 = self.c.loop.now
        self.link.feed(self.tr, n * self.c.kvb, last)

    def _pump(self) -> None:
        """Receiver: import the next chunk (one engine call), or complete after the last."""
        if self._importing or self.cancelled:
            return
        if self._imports:
            self._importing = True
            self.inst.run_command(self.hc.import_s_per_token * self._imports.popleft(), self._imported)
        elif self.final:
            self._importing = True
            self.inst.run_command(0.0, self._landed)

    def _imported(self) -> None:
        self._importing = False
        self.c.loop.after(0.0, self._pump)  # the next call arrives while the engine steps

    def _delivered(self) -> None:
        if self.hc is None:
            self._landed()
            return

        def complete():
            self.c.loop.after(0.0, lambda: self.inst.run_command(0.0, self._landed))

        self.inst.run_command(self.hc.import_s_per_token * self.tokens, complete)

    def _landed(self) -> None:
        if self.cancelled:
            return
        self.landed = True
        if self.estimator is not None:
            nbytes = int(self.tokens * self.c.kvb)
            self.c.back.message(lambda: self.estimator.done(self.planned, nbytes, self.c.loop.now - self.t0))
        self.on_landed(self.req)

    @property
    def bytes_sent(self) -> float:
        return self.tr.sent if (self.tr is not None and self.tr.cancelled) else self.tokens * self.c.kvb

    def cancel(self) -> None:
        """Stop the push (RLD finished first and late transfers are cancelled)."""
        if self.cancelled or self.landed:
            return
        self.cancelled = True
        if self.tr is not None and not self.tr.done:
            self.link.cancel(self.tr)
        if self.estimator is not None:
            self.estimator.done(self.planned, 0, 0.0, ok=False)
