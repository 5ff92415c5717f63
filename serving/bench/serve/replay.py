"""Replaying a trace against a router for `pddjax bench serve`: per-request records, the
two-phase replay (history, then measured turns), the unmeasured compile warm-up.

Replay, one thread per session:
1. *history*: every turn with arrival_s < 0 (sessions already in progress when the measured
   window opens, `WorkloadConfig.warm_start_s`), in session order, sessions concurrently, at
   once and unmeasured; `before_measure()` runs when all are done (the benchmark unshapes the
   WAN for this phase so caches warm in seconds, then shapes it, restarts the router and
   snapshots byte counters); it may return a new router address for the measured phase;
2. *measured*: turn n goes at max(arrival_s, end of turn n-1 + think_s) on the replay clock,
   which starts after the history phase: open loop for a fast enough system, closed loop
   within a session otherwise.
Prompts come from `TokenBuilder`, so turn n+1 extends turn n's prompt + the output the model
really produced (greedy, forced output lengths).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass
class Record:
    request_id: str
    session_id: int
    turn: int
    hit: float  # ideal prefix hit of the trace
    prompt_tokens: int
    send_s: float = 0.0  # since the measured phase started
    pipeline: str = ""
    ttft_ms: float = math.nan
    e2e_ms: float = math.nan
    tpot_ms: float = math.nan
    itl_ms: list = dataclasses.field(default_factory=list)  # a message of k tokens: k gaps of gap / k
    itl_message_ms: list = dataclasses.field(default_factory=list)  # one gap per message (vLLM's ITL)
    token_ids: list = dataclasses.field(default_factory=list)
    relay_tokens: int = 0
    main_tokens: int = 0
    cached_on_main: int = 0
    cached_on_prefill: int = 0
    kv_bytes_to_main: int = 0
    kv_to_main_ms: float = 0.0
    prefill_ms: float = 0.0  # P's Prefill call -> its first token (queue + prefill), as P reports it
    handoff_gap_ms: float | None = None
    explain: str = ""  # the router's decision, as it explained it
    error: str | None = None


class Progress:
    def __init__(self, label: str, total: int, stream=sys.stderr):
        self.label, self.total, self.done, self.stream = label, total, 0, stream
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.draw()

    def tick(self) -> None:
        with self.lock:
            self.done += 1
            self.draw()

    def draw(self) -> None:
        w = 30
        fill = int(w * self.done / max(1, self.total))
        self.stream.write(f"\r{self.label:<12} |{'#' * fill}{'-' * (w - fill)}| {self.done}/{self.total} "
                          f"{time.monotonic() - self.t0:6.1f} s")
        self.stream.flush()

    def finish(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def _fill(rec: Record, res, times: list, sent: float) -> None:
    """Client-side timings of one finished stream (`times`: (t, tokens, source) per message)."""
    rec.pipeline, rec.token_ids, rec.explain = res.pipeline, list(res.token_ids), res.explain
    rec.relay_tokens, rec.main_tokens = res.sources.count("relay"), res.sources.count("main")
    rec.cached_on_main = int(res.usage.get("cached_on_main", 0))
    rec.cached_on_prefill = int(res.usage.get("cached_on_prefill", 0))
    rec.kv_bytes_to_main = int(res.usage.get("kv_bytes_to_main", 0))
    rec.kv_to_main_ms = float(res.timings.get("kv_to_main_ms", 0.0))
    rec.prefill_ms = float(res.timings.get("prefill_ms", 0.0))
    if not times:
        return
    first, last = times[0][0], times[-1][0]
    rec.ttft_ms, rec.e2e_ms = 1e3 * (first - sent), 1e3 * (last - sent)
    n = sum(k for _, k, _ in times)
    rec.tpot_ms = 1e3 * (last - first) / (n - 1) if n > 1 else math.nan
    for (ta, _, _), (tb, k, _) in zip(times, times[1:]):
        rec.itl_ms += [1e3 * (tb - ta) / k] * k
        rec.itl_message_ms.append(1e3 * (tb - ta))
    if rec.relay_tokens and rec.main_tokens:
        from serving.pb import common_pb2

        relay_t = [t for t, _, s in times if s == common_pb2.ROLE_RELAY]
        main_t = [t for t, _, s in times if s == common_pb2.ROLE_MAIN]
        if relay_t and main_t:
            rec.handoff_gap_ms = 1e3 * (main_t[0] - relay_t[-1])


def replay(router: str, trace, pipeline: str, builder, handoff: str | None, label: str, timeout: float = 900.0,
           before_measure: Callable[[], str | None] | None = None) -> tuple[list[Record], float, list[Record], float]:
    """Replay `trace` against `router` -> (measured records, measured wall time, history records,
    history wall time: its first send to its last token, without `before_measure`)."""
    from serving.client import Client, RouterError, make_request

    sessions: dict[int, list] = {}
    for r in trace:
        sessions.setdefault(r.session_id, []).append(r)
    for turns in sessions.values():
        turns.sort(key=lambda r: r.turn)
    client = Client(router)
    clients = [client]
    lock = threading.Lock()
    clock = {"t0": time.perf_counter()}

    def one(req) -> tuple[Record, float]:
        with lock:
            prompt = builder.prompt_ids(req)
        sent = time.perf_counter()
        rec = Record(req.request_id, req.session_id, req.turn, req.hit, len(prompt), send_s=sent - clock["t0"])
        times: list[tuple[float, int, int]] = []  # (t, tokens, source of the first token)
        try:
            request = make_request(prompt, max_tokens=req.max_tokens, pipeline=pipeline, handoff=handoff,
                                   request_id=f"{req.request_id}", session_id=str(req.session_id), ignore_eos=True)
            res = clients[-1].generate(
                request, timeout=timeout,
                on_tokens=lambda m: times.append((time.perf_counter(), len(m.token_ids),
                                                  m.sources[0] if m.sources else 0)))
        except RouterError as e:
            rec.error = f"{e.code.name}: {e}"
            with lock:
                builder.record_output(req, [])
            return rec, time.perf_counter()
        with lock:
            builder.record_output(req, res.token_ids)
        _fill(rec, res, times, sent)
        return rec, time.perf_counter()

    def run_phase(name: str, pick, paced: bool, bar_label: str) -> list[Record]:
        todo = {sid: [r for r in turns if pick(r)] for sid, turns in sessions.items()}
        todo = {sid: turns for sid, turns in todo.items() if turns}
        total = sum(len(t) for t in todo.values())
        out: list[Record] = []
        if not total:
            return out
        bar = Progress(bar_label, total)

        def session(turns):
            prev_end = None
            for req in turns:
                if paced:
                    at = req.arrival_s if prev_end is None else max(req.arrival_s, prev_end - clock["t0"] + req.think_s)
                    delay = at - (time.perf_counter() - clock["t0"])
                    if delay > 0:
                        time.sleep(delay)
                rec, prev_end = one(req)
                with lock:
                    out.append(rec)
                bar.tick()

        threads = [threading.Thread(target=session, args=(t,), name=f"{name}-{sid}", daemon=True)
                   for sid, t in todo.items()]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        bar.finish()
        return out

    try:
        history = run_phase("history", lambda r: r.arrival_s < 0, False, f"{label} (hist)")
        history_wall = time.perf_counter() - clock["t0"]
        new_router = before_measure() if before_measure is not None else None
        if new_router and new_router != router:
            clients.append(Client(new_router))
        clock["t0"] = time.perf_counter()
        records = run_phase("measured", lambda r: r.arrival_s >= 0, True, label)
        wall = time.perf_counter() - clock["t0"]
    finally:
        for c in clients:
            c.close()
    records.sort(key=lambda r: (r.send_s, r.request_id))
    return records, wall, history, history_wall


def warmup(router: str, pipelines: list[str], vocab: int, prompt_len: int, handoff: str | None,
           sessions: int = 2) -> None:
    """Unmeasured requests that compile the step shapes the trace will use (new shapes compile
    on first use, seconds each on a CPU; the persistent cache makes later stacks fast):
    `sessions` concurrent sessions per pipeline, a cold prompt then a ~95%-hit follow-up, so
    prefill chunks, decode batches up to `sessions` and extend passes are seen. Own ids
    (seeded), so they only add a little to the caches."""
    from serving.client import Client, make_request

    c = Client(router)

    def session(i: int, p: str):
        rng = np.random.default_rng([12345, i])
        ids = rng.integers(16, vocab, prompt_len).tolist()
        for turn in range(2):
            r = c.generate(make_request(ids, max_tokens=16, pipeline=p, handoff=handoff, ignore_eos=True,
                                        request_id=f"warmup-{p}-{i}-{turn}"), timeout=900)
            ids = ids + r.token_ids + rng.integers(16, vocab, max(1, prompt_len // 20)).tolist()

    try:
        for k, p in enumerate(pipelines):
            threads = [threading.Thread(target=session, args=(sessions * k + j, p), daemon=True)
                       for j in range(sessions)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        c.close()
