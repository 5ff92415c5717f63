"""The simulated deployment: pools, lines, the router, and each request's life.

A request's life (PDD mode):
1. send: the turn is sent (turn 0 at its arrival, later turns think_s after the previous
   turn's last token). The router picks the P instance with the earliest predicted finish
   (queue + prefill given its cache hit) and the MD instance with the best DRC hit among the
   not-overloaded ones, and pins that DRC entry so the hit cannot be evicted meanwhile.
2. prefill: P computes the tokens its cache lacks (`prefill.py`).
3. route (`route.py`): KV delta for MD = prompt - DRC hit. If the WAN is predicted to deliver
   it within `rld_threshold_s`: P-MD. Otherwise dual path P-RLD-MD (full KV to RLD over RDMA,
   delta to MD over the WAN), or P-RLD when RLD would finish before the KV lands (singular
   filter) or when the drift experiment makes P-RLD a normal path.
4. decode on RLD / MD (`decode.py`), handoff by token ids (`handoff.py`).
5. finish: MD caches prompt + output in its DRC; the session's next turn is scheduled.
"""

from __future__ import annotations

from pddjax.sim.cache import PrefixCache
from pddjax.sim.config import ClusterConfig
from pddjax.sim.decode import DecodeInstance, Seq
from pddjax.sim.engine_prefill import EnginePrefill
from pddjax.sim.events import EventLoop, SimError
from pddjax.sim.handoff import Handoff
from pddjax.sim.host import Host, SerialWorker, couple
from pddjax.sim.lineage import Lineage
from pddjax.sim.prefill import PrefillInstance
from pddjax.sim.request import SimRequest
from pddjax.sim.route import Router
from pddjax.sim.wan import Line, fast_link
from pddjax.workload.trace import TraceRequest


def max_batch_for(perf, ctx: float, tpot_s: float, cap: int = 4096) -> int:
    """Largest batch whose decode step at mean context `ctx` fits `tpot_s` (at least 1)."""
    lo, hi = 1, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if perf.step_s(mid, mid * ctx) <= tpot_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Cluster:
    """Build with a config and a trace, then `run()`; finished requests are in `done`.

    History (turns with arrival_s < 0) is either loaded into the caches (`_warm`, default) or,
    with `replay_history` (what `bench serve` does), served first: every session's history
    turns back to back, sessions concurrently, on an unshaped line (cfg.host.unshaped_gbps,
    no delay); when all are done the line is shaped and the measured turns start, t0 = then."""

    def __init__(self, cfg: ClusterConfig, trace: list[TraceRequest], horizon: float | None = None,
                 replay_history: bool = False):
        if not trace:
            raise ValueError("empty trace")
        self.cfg, self.loop, self.lineage = cfg, EventLoop(), Lineage()
        self.kvb = cfg.p.perf.kv_bytes_per_token
        hc = cfg.host
        self.hosts: dict[tuple[int, ...], Host] = {}  # core set -> the host its services share
        self._busy_t0: dict[str, float] = {}  # CPU seconds per owner when the measured phase began
        self.shapes_before: dict[str, dict] = {}  # per engine: steps per shape when it began
        self._step_s_t0: dict[str, float] = {}  # per engine: solo seconds of its steps when it began
        p_host = self.host_for("prefill")
        ctx = self.mean_context = sum(r.prompt_tokens + r.output_tokens / 2 for r in trace) / len(trace)
        if hc:
            self.P = [EnginePrefill(self.loop, f"p{i}", cfg.p.perf, self.lineage, p_host, hc,
                                    self._chunk, self._prefilled) for i in range(cfg.p.count)]
        else:
            self.P = [PrefillInstance(self.loop, f"p{i}", cfg.p.perf, self.lineage, self._prefilled)
                      for i in range(cfg.p.count)]
        self._serializers = {p.name: SerialWorker(p_host, 1.0, f"{p.name}-loop") for p in self.P}
        self.fast = [fast_link(self.loop, cfg.fast_gbps, cfg.fast_latency_s) for _ in self.P]
        d_role = "relay" if cfg.mode == "pd-local" else "main"  # pd-local decodes on RLD's service
        self.D = [self._decode(f"d{i}", cfg.d.perf, ctx, cfg.batch_extend, d_role) for i in range(cfg.d.count)]
        self.R: list[DecodeInstance] = []
        if cfg.mode == "pdd":
            self.R = [self._decode(f"rld{i}", cfg.rld.perf, ctx, True, "relay") for i in range(cfg.rld.count)]
        if hc and hc.cross_slowdown and len(self.hosts) > 1:
            couple(list(self.hosts.values()), dict(hc.cross_slowdown))  # pinned core sets of one machine
        remote = cfg.mode != "pd-local"
        self.wan = Line(self.loop, cfg.wan_gbps, cfg.wan_latency_s, cfg.wan_jitter_s, cfg.wan_sharing, cfg.seed)
        self.back = Line(self.loop, cfg.wan_gbps, cfg.wan_latency_s, cfg.wan_jitter_s, "fair", cfg.seed + 1)
        lag = cfg.wan_latency_s if cfg.user_lag_s is None else cfg.user_lag_s
        self.user_lag = lag if remote else 0.0  # tokens from B reach users in A later
        self.router = Router(self)
        self.handoff = Handoff(self)
        self.done: list[SimRequest] = []
        # Requests sent after the horizon are not simulated (the measurement window ends there).
        self.horizon = horizon if horizon is not None else max(r.arrival_s for r in trace if r.turn == 0)
        self.sessions: dict[int, list[TraceRequest]] = {}
        for r in trace:
            self.sessions.setdefault(r.session_id, []).append(r)
        self.history = False
        for turns in self.sessions.values():
            turns.sort(key=lambda r: r.turn)
            if [r.turn for r in turns] != list(range(len(turns))):
                raise ValueError(f"session {turns[0].session_id}: turns are not 0..n-1")
        self.replay = replay_history
        if replay_history and hc is None:
            raise ValueError("replaying history needs a host config (its unshaped line)")
        self.t0 = 0.0  # measured turns are sent from here on (replay: after the history phase)
        if replay_history:
            self.history = any(r.arrival_s < 0 for r in trace)
            self._first_live = {sid: len([t for t in turns if t.arrival_s < 0]) for sid, turns in self.sessions.items()}
        else:
            self._warm(trace)
        self.n_sent = 0

    def busy_by_owner(self) -> dict[str, float]:
        """CPU seconds each owner (p0, p0-loop, d0, rld0) used on its host so far."""
        out: dict[str, float] = {}
        for h in self.hosts.values():
            for k, v in h.usage().items():
                out[k] = out.get(k, 0.0) + v
        return out

    def measured_cpu_s(self) -> dict[str, float]:
        """CPU seconds per owner since the measured phase began (t0)."""
        return {k: v - self._busy_t0.get(k, 0.0) for k, v in self.busy_by_owner().items()}

    def host_for(self, role: str) -> Host | None:
        """The Host a service of `role` ("prefill", "relay", "main") runs on: its pinned core
        set's (background load split by cores), or the one host of `cores` all share."""
        hc = self.cfg.host
        if hc is None:
            return None
        sets = {r: tuple(sorted(c)) for r, c in hc.cpus}
        if role in sets:
            key, n = sets[role], float(len(sets[role]))
            for other in sets.values():
                if other != key and set(other) & set(key):
                    raise ValueError(f"pinned core sets {key} and {other} overlap without being equal")
        else:
            key, n = (), hc.cores
        if key not in self.hosts:
            self.hosts[key] = Host(self.loop, n, hc.background_cores * n / hc.cores)
        return self.hosts[key]

    def _decode(self, name: str, perf, ctx: float, batch_extend: bool, role: str) -> DecodeInstance:
        hc = self.cfg.host
        if hc:
            return DecodeInstance(self.loop, name, perf, PrefixCache(hc.kv_tokens), hc.max_rows, batch_extend,
                                  self.host_for(role), hc.decode_cores)
        return DecodeInstance(self.loop, name, perf, PrefixCache(perf.kv_capacity_tokens),
                              max_batch_for(perf, ctx, self.cfg.tpot_target_s), batch_extend)

    def serializer(self, p_inst) -> SerialWorker:
        """P's asyncio thread (where its KV pushes are cut and serialized)."""
        return self._serializers[p_inst.name]

    def page_floor(self, tokens: int) -> int:
        """Prefix hits are whole pages on an engine host; token-exact otherwise."""
        S = self.cfg.host.page_size if self.cfg.host else 1
        return tokens // S * S

    def _warm(self, trace: list[TraceRequest]) -> None:
        """Load history (arrival_s < 0) into the caches, as if it had been served:
        P[sid % n_P] holds the last history prompt, D[sid % n_D] prompt + output; docs warm
        everywhere. Live sessions then start from their first turn at arrival_s >= 0."""
        hist = sorted((r for r in trace if r.arrival_s < 0), key=lambda r: r.arrival_s)
        self.history = bool(hist)
        last: dict[int, TraceRequest] = {}
        for r in hist:
            self.lineage.add(r.session_id, r.turn, r.prefix_tokens)
            last[r.session_id] = r
        docs = {r.doc_id: r.doc_tokens for r in trace}
        for inst in [*self.P, *self.D]:
            for doc, n in docs.items():
                inst.cache.insert(("d", doc), n, -1)
        for sid, r in sorted(last.items(), key=lambda kv: kv[1].arrival_s):
            self.P[sid % len(self.P)].cache.insert(("s", sid), r.prompt_tokens, r.turn)
            if self.cfg.drc:
                self.D[sid % len(self.D)].cache.insert(("s", sid), r.prompt_tokens + r.output_tokens, r.turn)
        self._first_live = {sid: len([t for t in turns if t.arrival_s < 0]) for sid, turns in self.sessions.items()}

    # ---- driving ---------------------------------------------------------------------
    def run(self) -> list[SimRequest]:
        if self.replay:
            cfg, hc = self.cfg, self.cfg.host
            self.wan.set_rate(hc.unshaped_gbps, 0.0, 0.0)
            self.back.set_rate(hc.unshaped_gbps, 0.0, 0.0)
            for turns in self.sessions.values():
                if turns[0].arrival_s < 0:
                    self._schedule(turns[0], 0.0)
            self.loop.run()
            self.t0 = self.loop.now
            self._busy_t0 = self.busy_by_owner()
            self.shapes_before = {i.name: dict(m.shapes) for i, m in self._step_models()}
            self._step_s_t0 = {i.name: m.seconds for i, m in self._step_models()}
            self.router.restart()  # bench serve restarts the router: fresh link estimates
            self.wan.set_rate(cfg.wan_gbps, cfg.wan_latency_s, cfg.wan_jitter_s)
            self.back.set_rate(cfg.wan_gbps, cfg.wan_latency_s, cfg.wan_jitter_s)
        for sid, turns in self.sessions.items():
            k = self._first_live[sid]
            if k < len(turns):
                self._schedule(turns[k], self.t0 + turns[k].arrival_s)
        self.loop.run()
        if len(self.done) != self.n_sent:
            raise SimError(f"{self.n_sent - len(self.done)} requests never finished")
        return self.done

    @staticmethod
    def step_model(inst):
        return getattr(inst, "steps", None) if isinstance(inst, EnginePrefill) else inst.steps_model

    def _step_models(self):
        """(engine, its StepModel) for every engine with a host."""
        for i in [*self.P, *self.D, *self.R]:
            m = self.step_model(i)
            if m is not None:
                yield i, m

    def measured_steps(self) -> dict[str, tuple[int, float]]:
        """Per engine: (steps, their solo seconds) in the measured phase."""
        return {i.name: (sum(m.shapes.values()) - sum(self.shapes_before.get(i.name, {}).values()),
                         m.seconds - self._step_s_t0.get(i.name, 0.0)) for i, m in self._step_models()}

    def new_shapes(self) -> dict[str, int]:
        """Per engine: step shapes first used in the measured phase (each a compile in a fresh
        engine whose warm-up did not run it). Needs a host; replayed history is the warm-up."""
        return {i.name: len(set(self.step_model(i).shapes) - set(self.shapes_before.get(i.name, {})))
                for i in [*self.P, *self.D, *self.R]}

    def measured(self) -> list[SimRequest]:
        """Finished requests of the measured phase (sent at or after t0)."""
        return [r for r in self.done if r.arrival >= self.t0 and r.tr.arrival_s >= 0]

    def _schedule(self, tr: TraceRequest, t: float) -> None:
        if t - self.t0 <= self.horizon:
            self.n_sent += 1
            self.loop.at(t, self._send, tr)

    def _send(self, tr: TraceRequest) -> None:
        req = SimRequest(tr)
        req.arrival = self.loop.now
        self.lineage.add(req.sid, req.turn, req.prefix)
        overhead = self.cfg.host.request_overhead_s if self.cfg.host else 0.0
        if overhead > 0:
            self.loop.after(overhead, self.router.admit, req)
        else:
            self.router.admit(req)

    def _chunk(self, req: SimRequest, a: int, b: int, last: bool) -> None:
        self.router.on_chunk(req, a, b, last)

    def _prefilled(self, req: SimRequest) -> None:
        self.router.prefilled(req)

    def complete(self, req: SimRequest) -> None:
        """A request's last token reached the user: record it and send the next turn."""
        if req.done:
            raise SimError(f"{req.rid} completed twice")
        req.done = True
        self.done.append(req)
        self.router.finished(req)
        turns = self.sessions[req.sid]
        if req.turn + 1 < len(turns):
            nxt = turns[req.turn + 1]
            if not self.replay:
                self._schedule(nxt, max(nxt.arrival_s, req.finish + nxt.think_s))
            elif nxt.arrival_s < 0:  # history: back to back
                self._schedule(nxt, max(self.loop.now, req.finish))
            elif req.tr.arrival_s >= 0:  # measured: closed loop within the session
                self._schedule(nxt, max(self.t0 + nxt.arrival_s, req.finish + nxt.think_s))

    # ---- decode-side helpers used by the router and the handoff ----------------------
    def direct_seq(self, req: SimRequest, inst: DecodeInstance, in_b: bool, pinned: int = 0) -> Seq:
        """A sequence that decodes from its first step on `inst` and finishes the request there."""
        lag = self.user_lag if in_b else 0.0
        seq = Seq(req, req.prompt + req.output - pinned, req.prompt, req.output - 1, True,
                  on_admit=lambda s: self._first_token(req, lag),
                  on_finish=lambda s: self.finish_on(req, inst, lag))
        seq.reserved = pinned
        self._check_fits(seq, inst)
        return seq

    def _first_token(self, req: SimRequest, lag: float) -> None:
        req.first_token = self.loop.now + lag

    def finish_on(self, req: SimRequest, inst: DecodeInstance, lag: float) -> None:
        """Last token emitted on `inst`: cache it in the DRC if this is a decode-pool instance."""
        req.finish = self.loop.now + lag
        if inst in self.D:
            req.md_tokens = req.output - req.rld_tokens
            self.cache_on_md(req, inst, req.prompt + req.output)
        else:
            req.rld_tokens, req.rld_last = req.output, self.loop.now
            self.cache_on_rld(req, req.prompt + req.output)
        self.complete(req)

    def own_hit(self, req: SimRequest, inst: DecodeInstance) -> int:
        """What a tier in A already holds of the prompt (whole pages, >= 1 token left to send)."""
        S = self.cfg.host.page_size
        return min(self.lineage.cached_hit(inst.cache, req) // S * S, (req.prompt - 1) // S * S)

    def cache_on_rld(self, req: SimRequest, tokens: int) -> None:
        """RLD releases a request with cache=True: its engine caches what it computed (host only)."""
        if self.cfg.host is not None and req.rld_inst is not None and tokens > 0:
            req.rld_inst.cache.insert(("s", req.sid), tokens, req.turn)

    def cache_on_md(self, req: SimRequest, inst: DecodeInstance, tokens: int) -> None:
        if not self.cfg.drc:
            return
        inst.cache.insert(("s", req.sid), tokens, req.turn)
        if req.turn == 0:
            old = inst.cache.get(("d", req.doc))
            if old is None or old.tokens < req.prefix:
                inst.cache.insert(("d", req.doc), req.prefix, -1)

    def unpin(self, req: SimRequest) -> None:
        """Give a pinned DRC entry back to MD's cache (the request will not use it)."""
        if req.md_pinned:
            req.md_inst.cache.release(req.md_pinned)
            req.md_inst.cache.insert(("s", req.sid), req.md_pinned, req.md_pinned_turn)
            req.md_pinned = 0

    @staticmethod
    def _check_fits(seq: Seq, inst: DecodeInstance) -> None:
        if seq.need + seq.reserved > inst.cache.capacity:
            raise SimError(f"{seq.req.rid} needs {seq.need + seq.reserved} KV tokens; {inst.name} holds "
                           f"{inst.cache.capacity}")

    def check_integrity(self) -> None:
        for inst in [*self.P, *self.D, *self.R]:
            inst.check_integrity()
        for host in self.hosts.values():
            host.check_integrity()
