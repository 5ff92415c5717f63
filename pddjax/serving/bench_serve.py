"""`pddjax bench serve`: the same agentic trace through PDD and its baselines, side by side.

Modes (each on a fresh stack: P, RLD, MD and the router as processes, MD behind the same
emulated WAN `WanLink`, so every mode starts with cold caches):
  pdd          the router's `auto` (P-MD for high hit, P-RLD-MD otherwise, the singular filter)
  pd-cross     every request P-MD, same DRC: the difference to pdd is RLD's latency masking
  pd-local     every request P-RLD: the same-datacenter floor (no WAN on the token path)
  pdd-drc-off  pdd with MD's prefix cache (DRC) off: the WAN bytes DRC saves
A run: build the trace (generated from a seed, or `--trace FILE`, format in
`pddjax.workload.trace`), then per mode start the stack, warm it up (compiles, unmeasured),
replay the trace (one thread per session; turn n is sent at max(arrival_s, end of turn n-1 +
think_s); prompts from `TokenBuilder`, so turn n+1 extends turn n's prompt + the output the
model really produced; greedy, forced output lengths), stop the stack. Then: per-mode figures,
the output-identity check across modes, the targets, a markdown table, the JSON and plots.

Definitions (client side, per request): TTFT = send -> first token; TPOT = (last token - first
token) / (tokens - 1), i.e. without TTFT; ITL = gaps between token-carrying stream messages,
a message of k tokens counting k gaps of gap/k; e2e = send -> last token; handoff gap = last
RLD token -> first MD token as the user sees it (requests that were handed off).
WAN bytes = emulator bytes A -> B during the replay (KV, handoff messages, gRPC framing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

from pddjax.errors import UserError

MODES = {"pdd": "auto", "pd-cross": "pd-cross", "pd-local": "pd-local", "pdd-drc-off": "auto"}
# Default emulated WAN: see WORKSPACE_NOTES.md "WAN scaling". SmolLM2-135M f32 KV is 46,080 B/token:
# a cold 2K prompt (~94 MB) takes ~7.5 s at 100 Mb/s, a 95%-hit turn (~100 new tokens, ~4.6 MB) ~0.4 s.
WAN_DEFAULTS = {"mbps": 100.0, "latency_ms": 20.0, "jitter_ms": 5.0, "jitter_dist": "normal"}


def register(bsub) -> None:
    p = bsub.add_parser("serve", help="replay an agentic trace through pdd, pd-cross, pd-local (+ DRC off)")
    p.add_argument("--json", required=True, help="write the figures to this file")
    p.add_argument("--quick", action="store_true", help="a short trace (4 sessions, 18 requests at seed 0)")
    p.add_argument("--trace", help="replay this JSONL trace instead of generating one")
    p.add_argument("--save-trace", help="also write the trace used to this JSONL file")
    p.add_argument("--plots", help="write PNG plots to this folder (needs matplotlib: the `plots` extra)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--config", help="base stack config (TOML/JSON); the benchmark sets model, [wan], DRC")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--seed", type=int, default=0, help="trace seed (generated traces)")
    p.add_argument("--duration", type=float, help="seconds of session arrivals (generated traces)")
    p.add_argument("--handoff", choices=["auto", "one-shot", "chunked"], help="handoff mode (default: the router's)")
    p.add_argument("--wan-mbps", type=float, default=WAN_DEFAULTS["mbps"])
    p.add_argument("--wan-latency-ms", type=float, default=WAN_DEFAULTS["latency_ms"])
    p.add_argument("--wan-jitter-ms", type=float, default=WAN_DEFAULTS["jitter_ms"])
    p.add_argument("--wan-jitter-dist", default=WAN_DEFAULTS["jitter_dist"],
                   choices=["normal", "uniform", "exponential", "pareto"])
    p.add_argument("--num-pages", type=int, help="KV pages per engine (default: 1024, tiny model 512)")
    p.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up requests")
    p.set_defaults(func=run)


# ---- the trace -------------------------------------------------------------------------
def bench_workload(quick: bool, seed: int, duration: float | None, model_config):
    """The generated workload: the `quick` preset (2K contexts, short heavy-tailed outputs,
    default hit mixture) at 0.2 sessions/s; --quick: 10 s of session starts and at most 5
    turns (seed 0: 4 sessions, 18 requests, mean hit 0.91), else 60 s and at most 8 turns.
    Shrunk to fit a small model's context (the tiny test model)."""
    from pddjax.workload import PRESETS

    cfg = dataclasses.replace(PRESETS["quick"], seed=seed, session_rate=0.2, turns_max=5 if quick else 8,
                              duration_s=duration or (10.0 if quick else 60.0))
    ctx = model_config.max_context
    if cfg.context_tokens * (1 + cfg.context_spread) + cfg.output_max + 8 > ctx:  # tiny model: scale down
        out_max = max(4, ctx // 16)
        cfg = dataclasses.replace(cfg, context_tokens=int((ctx - out_max - 8) / (1 + cfg.context_spread) * 0.8),
                                  output_max=out_max, output_median=max(2, out_max // 3))
    return cfg


def read_trace_seed(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        try:
            head = json.loads(f.readline() or "{}")
        except json.JSONDecodeError:
            return 0
    return int(head.get("config", {}).get("seed", 0)) if head.get("format") == "pddjax-trace" else 0


# ---- one stack -------------------------------------------------------------------------
class LinkThread:
    """The WanLink on its own event-loop thread (so the benchmark's sync clients can run)."""

    def __init__(self, target: str, wan: dict):
        from pddjax.serving.wanlink import WanLink

        self.link = WanLink.from_settings(target, wan)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="wanlink", daemon=True)
        self.thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self.link.start(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.link.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


class BenchStack:
    """P, RLD, MD, router as `pddjax serve` processes; P and RLD reach MD through the WAN link."""

    def __init__(self, stack: dict, workdir: str, timeout: float = 600.0):
        from pddjax.serving.up import spawn, wait_ready, write_json

        self.children, self.link = [], None
        self.log = open(os.path.join(workdir, "services.log"), "ab")
        try:
            cfg = os.path.join(workdir, "stack.json")
            write_json(cfg, stack)
            self.children = [spawn(r, cfg, workdir, log=self.log) for r in ("prefill", "relay", "main")]
            asyncio.run(wait_ready(self.children, timeout))
            addr = {c.role: c.address for c in self.children}
            self.link = LinkThread(addr["main"], stack.get("wan", {}))
            rstack = {**stack, "router": {**stack.get("router", {}), "prefill": addr["prefill"],
                                          "relay": addr["relay"], "main": addr["main"], "main_wan": self.link.address}}
            rcfg = os.path.join(workdir, "router.json")
            write_json(rcfg, rstack)
            router = spawn("router", rcfg, workdir, log=self.log)
            self.children.append(router)
            asyncio.run(wait_ready([router], timeout))
            self.router = router.address
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        from pddjax.serving.up import stop_all

        stop_all(self.children)
        if self.link is not None:
            self.link.close()
            self.link = None
        self.log.close()


# ---- replay ----------------------------------------------------------------------------
@dataclasses.dataclass
class Record:
    request_id: str
    session_id: int
    turn: int
    hit: float  # ideal prefix hit of the trace
    prompt_tokens: int
    send_s: float = 0.0  # since the replay started
    pipeline: str = ""
    ttft_ms: float = math.nan
    e2e_ms: float = math.nan
    tpot_ms: float = math.nan
    itl_ms: list = dataclasses.field(default_factory=list)
    token_ids: list = dataclasses.field(default_factory=list)
    relay_tokens: int = 0
    main_tokens: int = 0
    cached_on_main: int = 0
    cached_on_prefill: int = 0
    kv_bytes_to_main: int = 0
    kv_to_main_ms: float = 0.0
    handoff_gap_ms: float | None = None
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


def replay(router: str, trace, pipeline: str, builder, handoff: str, label: str, timeout: float = 900.0) -> tuple[list[Record], float]:
    """Replay `trace` against `router`; returns per-request records and the wall time."""
    from pddjax.serving.client import Client, RouterError, make_request

    sessions: dict[int, list] = {}
    for r in trace:
        sessions.setdefault(r.session_id, []).append(r)
    for turns in sessions.values():
        turns.sort(key=lambda r: r.turn)
    client = Client(router)
    lock = threading.Lock()
    records: list[Record] = []
    measured = [r for r in trace if r.arrival_s >= 0]
    bar = Progress(label, len(measured))
    t0 = time.perf_counter()

    def one(req, measure: bool):
        with lock:
            prompt = builder.prompt_ids(req)
        rec = Record(req.request_id, req.session_id, req.turn, req.hit, len(prompt), send_s=time.perf_counter() - t0)
        times: list[tuple[float, int, int]] = []  # (t, tokens, source of the first token)
        sent = time.perf_counter()
        try:
            res = client.generate(make_request(prompt, max_tokens=req.max_tokens, pipeline=pipeline, handoff=handoff,
                                               request_id=f"{req.request_id}", session_id=str(req.session_id),
                                               ignore_eos=True),
                                  timeout=timeout, on_tokens=lambda m: times.append((time.perf_counter(), len(m.token_ids),
                                                                                     m.sources[0] if m.sources else 0)))
        except RouterError as e:
            rec.error = f"{e.code.name}: {e}"
            with lock:
                builder.record_output(req, [])
            return rec, None
        end = time.perf_counter()
        with lock:
            builder.record_output(req, res.token_ids)
        rec.pipeline, rec.token_ids = res.pipeline, list(res.token_ids)
        rec.relay_tokens, rec.main_tokens = res.sources.count("relay"), res.sources.count("main")
        rec.cached_on_main = int(res.usage.get("cached_on_main", 0))
        rec.cached_on_prefill = int(res.usage.get("cached_on_prefill", 0))
        rec.kv_bytes_to_main = int(res.usage.get("kv_bytes_to_main", 0))
        rec.kv_to_main_ms = float(res.timings.get("kv_to_main_ms", 0.0))
        if times:
            first, last = times[0][0], times[-1][0]
            rec.ttft_ms, rec.e2e_ms = 1e3 * (first - sent), 1e3 * (last - sent)
            n = sum(k for _, k, _ in times)
            rec.tpot_ms = 1e3 * (last - first) / (n - 1) if n > 1 else math.nan
            for (ta, _, _), (tb, k, _) in zip(times, times[1:]):
                rec.itl_ms += [1e3 * (tb - ta) / k] * k
            if rec.relay_tokens and rec.main_tokens:
                from pddjax.serving.pb import common_pb2

                relay_t = [t for t, _, s in times if s == common_pb2.ROLE_RELAY]
                main_t = [t for t, _, s in times if s == common_pb2.ROLE_MAIN]
                if relay_t and main_t:
                    rec.handoff_gap_ms = 1e3 * (main_t[0] - relay_t[-1])
        return rec, end

    def session(turns):
        prev_end = None
        for req in turns:
            if req.arrival_s >= 0:  # history turns (negative arrival) go at once, unmeasured
                at = req.arrival_s if prev_end is None else max(req.arrival_s, prev_end - t0 + req.think_s)
                delay = at - (time.perf_counter() - t0)
                if delay > 0:
                    time.sleep(delay)
            rec, end = one(req, req.arrival_s >= 0)
            prev_end = end if end is not None else time.perf_counter()
            if req.arrival_s >= 0:
                with lock:
                    records.append(rec)
                bar.tick()

    threads = [threading.Thread(target=session, args=(t,), daemon=True) for t in sessions.values()]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    bar.finish()
    client.close()
    records.sort(key=lambda r: (r.send_s, r.request_id))
    return records, wall


def warmup(router: str, pipelines: list[str], vocab: int, prompt_len: int, handoff: str | None) -> None:
    """Unmeasured requests that compile the step shapes the trace will use (new shapes compile
    on first use, seconds each on a CPU; the persistent cache makes later stacks fast): two
    concurrent sessions per pipeline, a cold prompt then a ~95%-hit follow-up, so prefill
    chunks, decode at batch 1 and 2, and extend passes are seen. Own ids (seeded), so they
    only add a little to the caches."""
    from pddjax.serving.client import Client, make_request

    c = Client(router)

    def session(i: int, p: str):
        rng = np.random.default_rng([12345, i])
        ids = rng.integers(16, vocab, prompt_len).tolist()
        for turn in range(2):
            r = c.generate(make_request(ids, max_tokens=32, pipeline=p, handoff=handoff, ignore_eos=True,
                                        request_id=f"warmup-{p}-{i}-{turn}"), timeout=900)
            ids = ids + r.token_ids + rng.integers(16, vocab, max(1, prompt_len // 20)).tolist()

    try:
        for k, p in enumerate(pipelines):
            threads = [threading.Thread(target=session, args=(2 * k + j, p), daemon=True) for j in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        c.close()


# ---- figures ---------------------------------------------------------------------------
def pct(xs) -> dict:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None, "n": 0}
    a = np.asarray(xs, dtype=np.float64)
    return {"p50": round(float(np.percentile(a, 50)), 2), "p90": round(float(np.percentile(a, 90)), 2),
            "p99": round(float(np.percentile(a, 99)), 2), "max": round(float(a.max()), 2),
            "mean": round(float(a.mean()), 2), "n": int(a.size)}


def mode_figures(records: list[Record], wall: float, wan_bytes: int, wan_back: int) -> dict:
    ok = [r for r in records if r.error is None]
    out_tokens = sum(len(r.token_ids) for r in ok)
    relay = sum(r.relay_tokens for r in ok)
    ends = [r.send_s + r.e2e_ms / 1e3 for r in ok if not math.isnan(r.e2e_ms)]
    span = (max(ends) - min(r.send_s for r in ok)) if ends else wall
    pipes: dict[str, int] = {}
    for r in ok:
        pipes[r.pipeline] = pipes.get(r.pipeline, 0) + 1
    handed = [r for r in ok if r.handoff_gap_ms is not None]
    return {
        "requests": len(records), "completed": len(ok), "errors": len(records) - len(ok),
        "wall_s": round(wall, 2), "req_per_s": round(len(ok) / span, 4) if span > 0 else None,
        "ttft_ms": pct([r.ttft_ms for r in ok]), "tpot_ms": pct([r.tpot_ms for r in ok]),
        "itl_ms": pct([x for r in ok for x in r.itl_ms]), "e2e_ms": pct([r.e2e_ms for r in ok]),
        "wan_bytes": int(wan_bytes), "wan_bytes_b_to_a": int(wan_back),
        "kv_bytes_to_main": int(sum(r.kv_bytes_to_main for r in ok)),
        "kv_bytes_to_main_later_turns": int(sum(r.kv_bytes_to_main for r in ok if r.turn > 0)),
        "output_tokens": out_tokens, "rld_token_share": round(relay / out_tokens, 4) if out_tokens else 0.0,
        "pipelines": pipes,
        "handoff": {"count": len(handed), "gap_ms": pct([r.handoff_gap_ms for r in handed]),
                    "kv_to_main_ms": pct([r.kv_to_main_ms for r in ok if r.kv_to_main_ms > 0])},
        "md_hit_mean": round(float(np.mean([r.cached_on_main / r.prompt_tokens for r in ok
                                            if r.pipeline != "pd-local"] or [0.0])), 4),
        "p_hit_mean": round(float(np.mean([r.cached_on_prefill / r.prompt_tokens for r in ok] or [0.0])), 4),
    }


def identity_check(per_mode: dict[str, list[Record]]) -> dict:
    """Do all modes produce the same output tokens for every request? (Greedy: they should.)"""
    names = list(per_mode)
    if len(names) < 2:
        return {"identical": True, "compared": 0, "mismatches": []}
    ref = {r.request_id: r.token_ids for r in per_mode[names[0]] if r.error is None}
    mism, compared = [], 0
    for m in names[1:]:
        for r in per_mode[m]:
            if r.error is None and r.request_id in ref:
                compared += 1
                if r.token_ids != ref[r.request_id]:
                    i = next((k for k, (a, b) in enumerate(zip(r.token_ids, ref[r.request_id])) if a != b),
                             min(len(r.token_ids), len(ref[r.request_id])))
                    mism.append({"mode": m, "request_id": r.request_id, "first_diff": i, "against": names[0]})
    return {"identical": not mism, "compared": compared, "mismatches": mism[:20], "n_mismatches": len(mism)}


def targets(modes: dict) -> dict:
    out: dict = {}

    def p99(m):
        return (modes.get(m) or {}).get("ttft_ms", {}).get("p99")

    if p99("pdd") and p99("pd-cross"):
        r = p99("pdd") / p99("pd-cross")
        out["pdd_p99_over_pd_cross"] = {"value": round(r, 3), "target": "<= 0.5", "met": r <= 0.5}
    if p99("pdd") and p99("pd-local"):
        r = p99("pdd") / p99("pd-local")
        out["pdd_p99_over_pd_local"] = {"value": round(r, 3), "target": "<= 1.25", "met": r <= 1.25}
    if "pdd" in modes and "pdd-drc-off" in modes and modes["pdd"]["wan_bytes"]:
        r = modes["pdd-drc-off"]["wan_bytes"] / modes["pdd"]["wan_bytes"]
        out["wan_bytes_drc_off_over_on"] = {"value": round(r, 2), "target": ">= 5", "met": r >= 5}
        on, off = modes["pdd"]["kv_bytes_to_main_later_turns"], modes["pdd-drc-off"]["kv_bytes_to_main_later_turns"]
        if on:  # steady state: without the sessions' cold first turns (the report's regime)
            out["kv_bytes_later_turns_drc_off_over_on"] = {"value": round(off / on, 2), "target": "info", "met": True}
    return out


def markdown(result: dict) -> str:
    def f(x, d=0):
        return "-" if x is None else f"{x:.{d}f}"

    lines = ["| mode | done | TTFT p50 / p90 / p99 / max (ms) | TPOT p50 / p99 | ITL p50 / p99 | e2e p50 / p99 | req/s "
             "| WAN A->B (MB) | RLD share | pipelines | handoff gap p50 / max |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in result["modes"].items():
        t, tp, it, e, h = m["ttft_ms"], m["tpot_ms"], m["itl_ms"], m["e2e_ms"], m["handoff"]["gap_ms"]
        pipes = ", ".join(f"{k} {v}" for k, v in sorted(m["pipelines"].items()))
        lines.append(f"| {name} | {m['completed']}/{m['requests']} | {f(t['p50'])} / {f(t['p90'])} / {f(t['p99'])} / "
                     f"{f(t['max'])} | {f(tp['p50'], 1)} / {f(tp['p99'], 1)} | {f(it['p50'], 1)} / {f(it['p99'], 1)} | "
                     f"{f(e['p50'])} / {f(e['p99'])} | {f(m['req_per_s'], 3)} | {m['wan_bytes'] / 1e6:.1f} | "
                     f"{m['rld_token_share']:.1%} | {pipes} | {f(h['p50'])} / {f(h['max'])} |")
    lines.append("")
    for k, v in result["targets"].items():
        verdict = "info" if v["target"] == "info" else ("met" if v["met"] else "MISSED")
        lines.append(f"- {k}: {v['value']} ({'' if verdict == 'info' else 'target ' + v['target'] + ': '}{verdict})")
    ident = result["outputs"]
    lines.append(f"- outputs identical across modes: {ident['identical']} ({ident['compared']} requests compared, "
                 f"{ident.get('n_mismatches', 0)} differ)")
    return "\n".join(lines)


# ---- the command -----------------------------------------------------------------------
def _model_config(name: str):
    from pddjax.model.config import NAMED_CONFIGS

    if name in NAMED_CONFIGS:
        return NAMED_CONFIGS[name]
    from pddjax.model.registry import ModelNotFound, load_model

    try:
        return load_model(name).config
    except ModelNotFound as e:
        raise UserError(str(e)) from None


def stack_config(args, model_config, drc: bool) -> dict:
    from pddjax.serving.config import read_file

    base = read_file(args.config) if args.config else {}
    pages = args.num_pages or (512 if model_config.max_context <= 512 else 1024)
    engine = {"dtype": "float32", "page_size": 16, "num_pages": pages, "max_step_tokens": 256, "max_rows": 16,
              "prefix_cache": True, **base.get("engine", {})}
    if args.num_pages:
        engine["num_pages"] = args.num_pages
    return {**base, "model": args.model, "platform": base.get("platform", "cpu"), "engine": engine,
            "main": {**base.get("main", {}), "prefix_cache": drc},
            "router": {**base.get("router", {}), **({"handoff": args.handoff} if args.handoff else {})},
            "wan": {**base.get("wan", {}), "mbps": args.wan_mbps, "latency_ms": args.wan_latency_ms,
                    "jitter_ms": args.wan_jitter_ms, "jitter_dist": args.wan_jitter_dist}}


def _req_handoff(handoff: str | None) -> str | None:
    """The request's handoff field: unset (the router's setting) unless one-shot / chunked."""
    return handoff if handoff in ("one-shot", "chunked") else None


def run(args) -> int:
    from pddjax.workload import TokenBuilder, config_dict, generate, read_trace, summarize, write_trace

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise UserError(f"unknown mode {bad[0] if bad else '(none)'}: use {', '.join(MODES)}")
    if args.plots:
        from pddjax.serving import bench_serve_plots

        bench_serve_plots.require_matplotlib()
    mcfg = _model_config(args.model)
    if args.trace:
        try:
            trace = read_trace(args.trace)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read trace {args.trace}: {e}") from None
        trace_seed, wcfg = read_trace_seed(args.trace), None
    else:
        wcfg = bench_workload(args.quick, args.seed, args.duration, mcfg)
        trace, trace_seed = generate(wcfg), wcfg.seed
    if not trace:
        raise UserError("the trace has no requests")
    too_long = [r for r in trace if r.prompt_tokens + r.max_tokens > mcfg.max_context]
    if too_long:
        raise UserError(f"request {too_long[0].request_id} does not fit the model context ({mcfg.max_context} tokens)")
    if args.save_trace:
        write_trace(args.save_trace, trace, config_dict(wcfg) if wcfg else None)
    summary = summarize(trace)
    print(f"trace: {summary['requests']} requests, {summary['sessions']} sessions, mean hit {summary['mean_hit']:.2f}, "
          f"{summary['share_hit_above_95']:.0%} above 95%, mean prompt {summary['mean_prompt_tokens']:.0f}, "
          f"mean output {summary['mean_output_tokens']:.0f}", file=sys.stderr)
    prompt_len = int(summary["mean_prompt_tokens"])
    t_start = time.monotonic()
    per_mode: dict[str, list[Record]] = {}
    figures: dict[str, dict] = {}

    def build_result() -> dict:
        result = {
            "version": 1, "model": args.model, "quick": bool(args.quick), "handoff": args.handoff or "router default",
            "wan": stack_config(args, mcfg, True)["wan"],
            "kv_bytes_per_token": mcfg.kv_bytes_per_token,
            "trace": {"path": args.trace, "seed": trace_seed, "config": config_dict(wcfg) if wcfg else None, **summary},
            "modes": figures,
            "outputs": identity_check(per_mode),
            "wall_s": round(time.monotonic() - t_start, 1),
        }
        result["targets"] = targets(figures)
        result["requests"] = {m: [{"request_id": r.request_id, "hit": round(r.hit, 4), "pipeline": r.pipeline,
                                   "ttft_ms": None if math.isnan(r.ttft_ms) else round(r.ttft_ms, 2),
                                   "cached_on_main": r.cached_on_main, "prompt_tokens": r.prompt_tokens,
                                   "relay_tokens": r.relay_tokens, "main_tokens": r.main_tokens, "error": r.error}
                                  for r in recs] for m, recs in per_mode.items()}
        return result

    for mode in modes:
        workdir = tempfile.mkdtemp(prefix=f"pddjax-bench-{mode}-")
        stack_cfg = stack_config(args, mcfg, drc=(mode != "pdd-drc-off"))
        t0 = time.monotonic()
        print(f"{mode}: starting the stack", file=sys.stderr, flush=True)
        stack = BenchStack(stack_cfg, workdir)
        try:
            if not args.no_warmup:  # on an unshaped line, so no warm-up KV is still queued on the WAN
                pipes = ["pdd"] if MODES[mode] == "auto" else [MODES[mode]]  # pdd exercises P, RLD, MD
                link, mbps, lat = stack.link.link, stack.link.link.mbps, stack.link.link.latency_ms
                link.mbps, link.latency_ms = 0.0, 0.0
                try:
                    warmup(stack.router, pipes, mcfg.vocab_size, prompt_len, _req_handoff(args.handoff))
                finally:
                    link.mbps, link.latency_ms = mbps, lat
            before = stack.link.link.stats()
            builder = TokenBuilder(trace_seed, mcfg.vocab_size)
            records, wall = replay(stack.router, trace, MODES[mode], builder, _req_handoff(args.handoff), mode)
            after = stack.link.link.stats()
        finally:
            stack.close()
        shutil.rmtree(workdir, ignore_errors=True)
        per_mode[mode] = records
        figures[mode] = mode_figures(records, wall, after["bytes_a_to_b"] - before["bytes_a_to_b"],
                                     after["bytes_b_to_a"] - before["bytes_b_to_a"])
        figures[mode]["stack_s"] = round(time.monotonic() - t0 - wall, 1)
        errs = [r.error for r in records if r.error]
        if errs:
            print(f"{mode}: {len(errs)} requests failed, first: {errs[0]}", file=sys.stderr)
        with open(args.json, "w") as f:  # partial results after every mode (complete at the end)
            json.dump({**build_result(), "partial": mode != modes[-1]}, f, indent=1)
    result = build_result()
    table = markdown(result)
    print(table)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    if args.plots:
        from pddjax.serving import bench_serve_plots

        for path in bench_serve_plots.plot(result, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0
