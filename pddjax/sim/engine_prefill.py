"""A prefill (P) instance that runs like pddjax's P service, step by step, on a shared host.

What the real P does (serving/engine/prefill.py, engines/paged_engine.py):
- admission: the prompt joins the engine at once (no FIFO of whole prompts); its prefix-cache
  hit is page-granular and leaves at least one token to compute; the cached part's KV is
  exported and streamed to the targets right away (a command on the engine thread);
- every step packs the sequences with pending tokens, fewest pending first, up to
  `step_tokens` tokens and `max_rows` rows (a short high-hit prompt overtakes a cold one),
  (`buckets.pack_rows`, the engine's own row chooser) each row as many tokens as still fit a
  member of the engine's stated shape set
  (`buckets.fit_row`: a row joining others takes a mixed member, Q < T), stopping before a
  row that fits none or would pad the step's query block past `pad_limit` (`buckets.pads_past`:
  the member's B x Q against pad_limit x the step's tokens); a step that left a multi-token
  row out puts those rows first next time (`buckets.step_order`). Page tables are not
  modelled: every member's width holds any row;
  after the step each row's new KV is exported and streamed (`on_chunk(req, a, b, last)`);
- the step that finishes a prompt samples its first token; P keeps the prompt in its cache,
  and its pages stay held (leased: not evictable, though its cache serves them) until every
  push of the prompt's KV has been acknowledged or cancelled (`push_done`).
Steps and commands run one at a time on the instance's engine thread; each is a job on the
shared `Host` (steps keep `step_cores` busy, exports one core).
"""

from __future__ import annotations

import types
from collections import deque
from collections.abc import Callable

from pddjax.engines import buckets
from pddjax.sim.cache import PrefixCache
from pddjax.sim.config import HostConfig
from pddjax.sim.engine_steps import StepModel
from pddjax.sim.events import EventLoop, SimError
from pddjax.sim.host import Host, step_class
from pddjax.sim.lineage import Lineage


class _Job:
    __slots__ = ("export_from", "held", "pending", "req", "upto")

    def __init__(self, req, hit: int, export_from: int, held: int):
        self.req, self.pending, self.upto = req, req.prompt - hit, hit
        self.export_from, self.held = export_from, held

    @property
    def num_pending(self) -> int:  # as engines.sequence.Sequence (buckets.step_order sorts by it)
        return self.pending


def step_members(hc: HostConfig) -> list[buckets.Shape]:
    """The stated step shapes of an engine with `hc`'s step_tokens, max_rows, pad_limit and
    page_size (`buckets.bucket_set`), at one page-table width: the sim tracks no page tables."""
    config = types.SimpleNamespace(max_step_tokens=hc.step_tokens, max_rows=hc.max_rows, pad_limit=hc.pad_limit,
                                   page_size=hc.page_size, num_pages=buckets.MIN_WIDTH + 1)
    return buckets.bucket_set(config, types.SimpleNamespace(max_context=buckets.MIN_WIDTH * hc.page_size))


class EnginePrefill:
    """One P instance; `submit(req, export_from)`; `on_chunk` per exported piece, `on_done` at the end."""

    streams = True

    def __init__(self, loop: EventLoop, name: str, perf, lineage: Lineage, host: Host, hc: HostConfig,
                 on_chunk: Callable, on_done: Callable):
        self.loop, self.name, self.perf, self.lineage, self.host, self.hc = loop, name, perf, lineage, host, hc
        self.steps = StepModel(perf)
        self.cache = PrefixCache(hc.kv_tokens)
        self.on_chunk, self.on_done = on_chunk, on_done
        self.jobs: list[_Job] = []  # admission order
        self.commands: deque[tuple[float, Callable[[], None]]] = deque()
        self.busy = False
        self.busy_time = 0.0
        self.tokens_computed = 0
        self.n_steps = 0
        self.leases: set[str] = set()  # requests whose KV pushes P still holds pages for
        self.members = step_members(hc)
        self._wide = hc.step_tokens * max(1, hc.step_tokens)  # page tables not modelled: no row is too wide
        self._multi_first = False  # the last step left a multi-token row out (buckets.step_order)

    # ---- queries ---------------------------------------------------------------------
    def hit_for(self, req) -> int:
        """Prompt tokens the engine would take from its cache now: whole pages, >= 1 left."""
        S = self.hc.page_size
        hit = self.lineage.cached_hit(self.cache, req)
        return min(hit // S * S, (req.prompt - 1) // S * S)

    def predict_s(self, req) -> float:
        """Rough seconds until `req` would finish here (queued tokens at full-step speed)."""
        tokens = sum(j.pending for j in self.jobs) + req.prompt - self.hit_for(req)
        return tokens * self.steps.lin(self.hc.step_tokens) / self.hc.step_tokens

    # ---- mutations -------------------------------------------------------------------
    def submit(self, req, export_from: int = 0, hit: int | None = None) -> None:
        """Admit `req`; KV from token `export_from` on is exported for the targets; `hit`
        overrides the cache lookup (a sync: P holds the prompt it extends)."""
        hit = self.hit_for(req) if hit is None else hit
        entry = self.cache.take(("s", req.sid))  # pin the session prefix while we extend it
        pinned = entry.tokens if entry else 0
        self.cache.touch(("d", req.doc))
        working = max(0, req.prompt - pinned)
        held = pinned + (working if self.cache.reserve(working) else 0)
        req.prefill_start, req.p_hit, req.p_inst = self.loop.now, hit, self
        job = _Job(req, hit, export_from, held)
        self.jobs.append(job)
        if hit > export_from:  # the cached part goes out at once
            self.commands.append((self.hc.export_s_per_token * (hit - export_from),
                                  lambda: self.on_chunk(req, export_from, hit, False)))
        self.loop.after(0.0, self._kick)  # the engine thread takes every command queued now, then steps

    def run_command(self, work: float, fn: Callable[[], None]) -> None:
        """Engine-thread work between steps (an RPC such as MatchPrefix): fn() when done."""
        self.commands.append((work, fn))
        self.loop.after(0.0, self._kick)

    def _kick(self) -> None:
        if self.busy:
            return
        if self.commands:
            work = sum(w for w, _ in self.commands)
            fns = [f for _, f in self.commands]
            self.commands.clear()
            self.busy = True
            self.host.run(work, 1.0, lambda: self._commands_done(fns), self.name)
            return
        if not self.jobs:
            return
        rows, self._multi_first = buckets.pack_rows(  # as PagedEngine.step (stable: ties in admission order)
            self.members, self.hc.pad_limit, list(self.jobs), self.hc.step_tokens, self.hc.max_rows,
            self._multi_first, self._wide)
        work = self.steps.step_s(chunks=[(n, j.upto + n) for j, n in rows])
        exported = sum(max(0, j.upto + n - max(j.upto, j.export_from)) for j, n in rows)
        work += self.hc.export_s_per_token * exported
        self.busy = True
        self.busy_time += work
        self.n_steps += 1
        kind = step_class(sum(n for _, n in rows), len(rows), decode_only=False)
        self.host.run(work, self.hc.step_cores, lambda: self._step_done(rows), self.name, kind)

    def _commands_done(self, fns) -> None:
        self.busy = False
        for fn in fns:
            fn()
        self._kick()

    def _step_done(self, rows) -> None:
        self.busy = False
        for job, n in rows:
            a = job.upto
            job.upto += n
            job.pending -= n
            self.tokens_computed += n
            last = job.pending == 0
            self.on_chunk(job.req, max(a, job.export_from), job.upto, last)
            if last:
                self._finish(job)
        self._kick()

    def _finish(self, job: _Job) -> None:
        req = job.req
        self.jobs.remove(job)
        self.cache.release(job.held)
        self.cache.insert(("s", req.sid), req.prompt, req.turn)
        if any(not (s.landed or s.cancelled) for s in req.streams):
            self.cache.lease(("s", req.sid))
            self.leases.add(req.rid)
        if req.turn == 0:
            old = self.cache.get(("d", req.doc))
            if old is None or old.tokens < req.prefix:
                self.cache.insert(("d", req.doc), req.prefix, -1)
        req.prefill_end = self.loop.now
        self.on_done(req)

    def push_done(self, req) -> None:
        """One of `req`'s pushes was acknowledged or cancelled: free its lease after the last."""
        if req.rid in self.leases and all(s.landed or s.cancelled for s in req.streams):
            self.leases.discard(req.rid)
            self.cache.unlease(("s", req.sid))

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        if any(j.pending <= 0 for j in self.jobs):
            raise SimError(f"{self.name}: a finished prompt is still admitted")
