"""`pddjax bench serve`: the same agentic trace through PDD and its baselines, side by side.

Modes (each on a fresh stack: P, RLD, MD and the router as processes, MD behind the same
emulated WAN `WanLink`, so every mode starts with cold caches; P gets its own cores and the
decoders the rest (`cluster_cpus`), `--no-pin` to share them):
  pdd          the router's `auto` (P-MD for high hit, P-RLD-MD otherwise, the singular filter)
  pd-cross     every request P-MD, same DRC: the difference to pdd is RLD's latency masking
  pd-local     every request P-RLD: the same-datacenter floor (no WAN on the token path)
  pdd-drc-off  pdd with MD's prefix cache (DRC) off: the WAN bytes DRC saves
A run: build the trace (generated from a seed, or `--trace FILE`, format in
`pddjax.workload.trace`), then per mode start the stack, warm it up (compiles, unmeasured),
replay the trace (`bench_replay`: the history turns unmeasured on an unshaped line so the
caches are warm, the router restarted so its link estimates are fresh, then the measured
turns on the shaped line), stop the stack. Then: per-mode figures, the output-identity check
across modes, the targets, a markdown table, the JSON and plots.

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
from pddjax.serving.bench_replay import Record, replay, warmup

MODES = {"pdd": "auto", "pd-cross": "pd-cross", "pd-local": "pd-local", "pdd-drc-off": "auto"}
# Default emulated WAN: see WORKSPACE_NOTES.md "WAN scaling". SmolLM2-135M f32 KV is 46,080 B/token:
# a cold 1K prompt (~47 MB) takes ~19 s at 20 Mb/s, a 95%-hit turn (~50 new tokens, ~2.3 MB) ~0.9 s.
WAN_DEFAULTS = {"mbps": 20.0, "latency_ms": 20.0, "jitter_ms": 5.0, "jitter_dist": "normal"}


def register(bsub) -> None:
    p = bsub.add_parser("serve", help="replay an agentic trace through pdd, pd-cross, pd-local (+ DRC off)")
    p.add_argument("--json", required=True, help="write the figures to this file")
    p.add_argument("--quick", action="store_true", help="a short trace (seed 0: 7 sessions, 22 measured requests after 13 history turns)")
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
    p.add_argument("--no-pin", action="store_true",
                   help="do not pin services to cores (default: P on its own cores, RLD and MD on the rest)")
    p.set_defaults(func=run)


# ---- the trace -------------------------------------------------------------------------
def bench_workload(quick: bool, seed: int, duration: float | None, model_config):
    """The generated workload: 1K-token contexts over 2 shared docs, short heavy-tailed outputs
    (median 24), the default hit mixture, sessions also in progress before t=0 (15 s of
    history, replayed unmeasured to warm the caches: the report's steady state).
    --quick: 20 s of session starts at 0.15/s (seed 0: 22 measured requests in 7 sessions,
    mean hit 0.87, 73% above 95%, plus 13 history turns); else 120 s at 0.1/s.
    Shrunk to fit a small model's context (the tiny test model)."""
    from pddjax.workload import PRESETS

    cfg = dataclasses.replace(PRESETS["quick"], seed=seed, context_tokens=1024, output_median=24, output_max=160,
                              n_docs=2, think_mean_s=1.0, turns_mean=5.0, turns_max=8, warm_start_s=15.0,
                              session_rate=0.15 if quick else 0.1, duration_s=duration or (20.0 if quick else 120.0))
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


def cluster_cpus() -> dict[str, list[int]]:
    """Cores per service, as on separate accelerators: P gets its own (a P instance is its own
    GPU in the report, and TTFT is mostly P's prefill), the decoders get the rest: with 3+ CPUs
    RLD and MD get a third each (MD's own cores are its own datacenter); with 2, RLD and MD share
    the second core (they overlap only until a handoff). The router and this process (client
    threads, the WAN emulator) float: on 2 CPUs, putting them on the decoders' core overloaded
    it (TTFT P99 of every mode +50-200%). Unpinned, every service's work slows
    every other's on one host, which no real deployment sees. One CPU: nothing pinned."""
    cpus = sorted(os.sched_getaffinity(0))
    n = len(cpus)
    if n < 2:
        return {}
    if n == 2:
        return {"prefill": cpus[:1], "relay": cpus[1:], "main": cpus[1:]}
    k = n // 3
    return {"prefill": cpus[: n - 2 * k], "relay": cpus[n - 2 * k: n - k], "main": cpus[n - k:]}


class BenchStack:
    """P, RLD, MD, router as `pddjax serve` processes; P and RLD reach MD through the WAN link."""

    def __init__(self, stack: dict, workdir: str, timeout: float = 600.0, pin: bool = True):
        from pddjax.serving.up import spawn, wait_ready, write_json

        self.children, self.link, self.router_child, self.workdir, self.cpus = [], None, None, workdir, {}
        self.timeout = timeout
        self.log = open(os.path.join(workdir, "services.log"), "ab")
        try:
            cfg = os.path.join(workdir, "stack.json")
            write_json(cfg, stack)
            self.cpus = cluster_cpus() if pin else {}
            self.children = [spawn(r, cfg, workdir, log=self.log, cpus=self.cpus.get(r))
                             for r in ("prefill", "relay", "main")]
            asyncio.run(wait_ready(self.children, timeout))
            addr = {c.role: c.address for c in self.children}
            self.link = LinkThread(addr["main"], stack.get("wan", {}))
            rstack = {**stack, "router": {**stack.get("router", {}), "prefill": addr["prefill"],
                                          "relay": addr["relay"], "main": addr["main"], "main_wan": self.link.address}}
            self.router_cfg = os.path.join(workdir, "router.json")
            write_json(self.router_cfg, rstack)
            self.start_router()
        except BaseException:
            self.close()
            raise

    def start_router(self) -> None:
        """(Re)start the router: after the history phase, so its link estimates, session
        tracker and counters start fresh while P's and MD's caches stay warm."""
        from pddjax.serving.up import spawn, stop_all, wait_ready

        if self.router_child is not None:
            stop_all([self.router_child])
            self.children.remove(self.router_child)
            os.remove(self.router_child.ready_file)
        self.router_child = spawn("router", self.router_cfg, self.workdir, log=self.log)
        self.children.append(self.router_child)
        asyncio.run(wait_ready([self.router_child], self.timeout))
        self.router = self.router_child.address

    def close(self) -> None:
        from pddjax.serving.up import stop_all

        stop_all(self.children)
        if self.link is not None:
            self.link.close()
            self.link = None
        self.log.close()


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
        "kv_tokens_to_main": int(sum(r.prompt_tokens - r.cached_on_main for r in ok if r.pipeline != "pd-local")),
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


def targets(modes: dict, per_mode: dict | None = None) -> dict:
    out: dict = {}
    same = _same_requests_kv(per_mode or {})

    def p99(m):
        return (modes.get(m) or {}).get("ttft_ms", {}).get("p99")

    if p99("pdd") and p99("pd-cross"):
        r = p99("pdd") / p99("pd-cross")
        out["pdd_p99_over_pd_cross"] = {"value": round(r, 3), "target": "<= 0.5", "met": r <= 0.5}
    if p99("pdd") and p99("pd-local"):
        r = p99("pdd") / p99("pd-local")
        out["pdd_p99_over_pd_local"] = {"value": round(r, 3), "target": "<= 1.25", "met": r <= 1.25}
    # DRC: the KV the requests put on the line = prompt tokens MD lacked, per request through MD
    # (delivered bytes cannot show it: a 20 Mb/s line carries ~2.5 MB/s whatever is queued).
    # The target compares the same requests (those through MD in both runs): with DRC off the
    # policy keeps more requests local (their KV would land after RLD finished), which is not DRC.
    if same:
        r = same[1] / max(1, same[0])
        out["wan_kv_drc_off_over_on"] = {"value": round(r, 2), "target": ">= 5", "met": r >= 5}
    if "pdd" in modes and "pdd-drc-off" in modes and modes["pdd"]["kv_tokens_to_main"]:
        r = modes["pdd-drc-off"]["kv_tokens_to_main"] / modes["pdd"]["kv_tokens_to_main"]
        out["wan_kv_all_requests_drc_off_over_on"] = {"value": round(r, 2), "target": "info", "met": True}
    if "pdd" in modes and "pdd-drc-off" in modes and modes["pdd"]["wan_bytes"]:
        r = modes["pdd-drc-off"]["wan_bytes"] / modes["pdd"]["wan_bytes"]
        out["wan_bytes_delivered_drc_off_over_on"] = {"value": round(r, 2), "target": "info", "met": True}
    return out


def _same_requests_kv(per_mode: dict) -> tuple[int, int] | None:
    """(KV tokens to MD with DRC, without) over requests that went through MD in both runs."""
    on, off = per_mode.get("pdd"), per_mode.get("pdd-drc-off")
    if not on or not off:
        return None
    a = {r.request_id: r for r in on if r.error is None and r.pipeline != "pd-local"}
    b = {r.request_id: r for r in off if r.error is None and r.pipeline != "pd-local"}
    both = a.keys() & b.keys()
    if not both:
        return None
    return (sum(a[k].prompt_tokens - a[k].cached_on_main for k in both),
            sum(b[k].prompt_tokens - b[k].cached_on_main for k in both))


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
            # the operator's prior for the line = its provisioned rate (then measured transfers)
            "router": {"wan_mbps_prior": args.wan_mbps, "wan_latency_ms_prior": args.wan_latency_ms,
                       **base.get("router", {}), **({"handoff": args.handoff} if args.handoff else {})},
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
    summary = summarize([r for r in trace if r.arrival_s >= 0] or trace)
    print(f"trace: {summary['requests']} requests, {summary['sessions']} sessions, mean hit {summary['mean_hit']:.2f}, "
          f"{summary['share_hit_above_95']:.0%} above 95%, mean prompt {summary['mean_prompt_tokens']:.0f}, "
          f"mean output {summary['mean_output_tokens']:.0f}", file=sys.stderr)
    prompt_len = int(summary["mean_prompt_tokens"])
    history_turns = sum(r.arrival_s < 0 for r in trace)
    t_start = time.monotonic()
    per_mode: dict[str, list[Record]] = {}
    figures: dict[str, dict] = {}

    def build_result() -> dict:
        result = {
            "version": 1, "model": args.model, "quick": bool(args.quick), "handoff": args.handoff or "router default",
            "cpus": None if args.no_pin else cluster_cpus(),  # per service; the router and the WAN link float
            "wan": stack_config(args, mcfg, True)["wan"],
            "kv_bytes_per_token": mcfg.kv_bytes_per_token,
            "trace": {"path": args.trace, "seed": trace_seed, "config": config_dict(wcfg) if wcfg else None, **summary},
            "modes": figures,
            "outputs": identity_check(per_mode),
            "wall_s": round(time.monotonic() - t_start, 1),
        }
        result["targets"] = targets(figures, per_mode)
        result["requests"] = {m: [{"request_id": r.request_id, "hit": round(r.hit, 4), "pipeline": r.pipeline,
                                   "ttft_ms": None if math.isnan(r.ttft_ms) else round(r.ttft_ms, 2),
                                   "cached_on_main": r.cached_on_main, "prompt_tokens": r.prompt_tokens,
                                   "relay_tokens": r.relay_tokens, "main_tokens": r.main_tokens, "explain": r.explain,
                                   "send_s": round(r.send_s, 3), "prefill_ms": round(r.prefill_ms, 1),
                                   "error": r.error}
                                  for r in recs] for m, recs in per_mode.items()}
        return result

    for mode in modes:
        workdir = tempfile.mkdtemp(prefix=f"pddjax-bench-{mode}-")
        stack_cfg = stack_config(args, mcfg, drc=(mode != "pdd-drc-off"))
        t0 = time.monotonic()
        print(f"{mode}: starting the stack", file=sys.stderr, flush=True)
        stack = BenchStack(stack_cfg, workdir, pin=not args.no_pin)
        link = stack.link.link
        shaped = (link.mbps, link.latency_ms)
        counters: dict = {}

        def measure_from_here(stack=stack, link=link, shaped=shaped, counters=counters):
            """History done: shape the line, restart the router (fresh link estimates), count bytes."""
            if history_turns:
                stack.start_router()
            link.mbps, link.latency_ms = shaped
            counters["before"] = link.stats()
            return stack.router

        try:
            link.mbps, link.latency_ms = 0.0, 0.0  # warm-up and history on an unshaped line
            if not args.no_warmup:
                pipes = ["pdd"] if MODES[mode] == "auto" else [MODES[mode]]  # pdd exercises P, RLD, MD
                # the first stack compiles (3 sessions: decode batch buckets 1, 2 and 4); later
                # ones find the executables in the persistent cache
                warmup(stack.router, pipes, mcfg.vocab_size, prompt_len, _req_handoff(args.handoff),
                       sessions=3 if mode == modes[0] else 2)
            builder = TokenBuilder(trace_seed, mcfg.vocab_size)
            t_hist = time.monotonic()
            records, wall, history = replay(stack.router, trace, MODES[mode], builder, _req_handoff(args.handoff),
                                            mode, before_measure=measure_from_here)
            after = link.stats()
        finally:
            stack.close()
        shutil.rmtree(workdir, ignore_errors=True)
        per_mode[mode] = records
        before = counters["before"]
        figures[mode] = mode_figures(records, wall, after["bytes_a_to_b"] - before["bytes_a_to_b"],
                                     after["bytes_b_to_a"] - before["bytes_b_to_a"])
        figures[mode]["stack_s"] = round(t_hist - t0, 1)  # start + warm-up
        figures[mode]["history_s"] = round(time.monotonic() - t_hist - wall, 1)
        figures[mode]["history_errors"] = sum(r.error is not None for r in history)
        errs = [r.error for r in records + history if r.error]
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
