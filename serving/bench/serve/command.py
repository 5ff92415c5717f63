"""`pddjax bench serve`: the same agentic trace through PDD and its baselines, side by side.

Modes (each on a fresh stack: P, RLD, MD and the router as processes, MD behind the same
emulated WAN `WanLink`, so every mode starts with cold caches; P gets its own cores and the
decoders the rest (`cluster_cpus`), `--no-pin` to share them):
  pdd          the router's `auto` (P-MD for high hit, P-RLD-MD otherwise, the singular filter)
  pd-cross     every request P-MD, same DRC: the difference to pdd is RLD's latency masking
  pd-local     every request P-RLD: the same-datacenter floor (no WAN on the token path)
  pdd-drc-off  pdd with MD's prefix cache (DRC) off: the WAN bytes DRC saves
  pdd-int8     pdd with int8 KV on the WAN (`[wan] kv_wire`; any `pdd-FMT`, FMT a pddjax.kv.codec
               format, e.g. pdd-bf16, pdd-fp8+zstd): the bytes, RLD share and TTFT a compact
               KV wire format buys; lossy, so outside the output-identity check (`outputs.lossy`)
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
compiles_after_ready = step compiles each engine service made after it reported SERVING (the
warm-up included), per service and in total (`serving.bench.serve.compiles`); compiles_measured =
those of the measured phase alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import tempfile
import time

from pddjax.errors import UserError
from serving.bench.serve import compiles, peer_command
from serving.bench.serve.figures import identity_check, kv_wire_of, markdown, mode_figures, targets, wire_mode_format
from serving.bench.serve.replay import Record, replay, warmup
from serving.bench.serve.stack import BenchStack, cluster_cpus

__all__ = ["MODES", "BenchStack", "Record", "cluster_cpus", "register", "run"]

MODES = {"pdd": "auto", "pd-cross": "pd-cross", "pd-local": "pd-local", "pdd-drc-off": "auto", "pdd-int8": "auto"}
# Default emulated WAN: docs/decisions.md, "Benchmarks and measurement method". SmolLM2-135M f32 KV is 46,080 B/token:
# a cold 1K prompt (~47 MB) takes ~19 s at 20 Mb/s, a 95%-hit turn (~50 new tokens, ~2.3 MB) ~0.9 s.
WAN_DEFAULTS = {"mbps": 20.0, "latency_ms": 20.0, "jitter_ms": 5.0, "jitter_dist": "normal"}


def register(bsub) -> None:
    p = bsub.add_parser("serve", help="replay an agentic trace through pdd, pd-cross, pd-local (+ DRC off)")
    p.add_argument("--json", required=True, help="write the figures to this file")
    p.add_argument("--quick", action="store_true",
                   help="a short trace (seed 0: 7 sessions, 22 measured requests after 13 history turns)")
    p.add_argument("--trace", help="replay this JSONL trace instead of generating one")
    p.add_argument("--save-trace", help="also write the trace used to this JSONL file")
    p.add_argument("--plots", help="write PNG plots to this folder (needs matplotlib: the `plots` extra)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--config", help="base stack config (TOML/JSON); the benchmark sets model, [wan], DRC")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma list of {', '.join(MODES)} (or pdd-FMT: pdd with KV wire format FMT on the WAN)")
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
    o = p.add_argument_group("any OpenAI-compatible server (serving/bench/serve/openai_driver.py)")
    o.add_argument("--openai-url", metavar="URL",
                   help="replay the trace against this OpenAI-compatible base URL (e.g. pddjax up's `openai`, "
                        "http://HOST:PORT/v1) instead of starting stacks; --model names its vocabulary")
    o.add_argument("--openai-model", help="the `model` field sent (default: the first of GET /v1/models)")
    o.add_argument("--openai-key", help="the API key (pddjax: the router's bearer token)")
    peer_command.add_arguments(p)
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


def mode_pipeline(mode: str) -> str | None:
    """The router pipeline a mode asks for (`pdd-FMT`: auto); None for an unknown mode."""
    return MODES.get(mode) or ("auto" if wire_mode_format(mode) else None)


def stack_config(args, model_config, drc: bool, kv_wire: str = "native") -> dict:
    from serving.config import read_file

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
                       **{k: v for k, v in base.get("router", {}).items() if k != "kv_wire"},  # the mode's: [wan]
                       **({"handoff": args.handoff} if args.handoff else {})},
            "wan": {**base.get("wan", {}), "mbps": args.wan_mbps, "latency_ms": args.wan_latency_ms,
                    "jitter_ms": args.wan_jitter_ms, "jitter_dist": args.wan_jitter_dist,
                    "kv_wire": kv_wire}}  # the mode's P -> MD format (as `pddjax up --kv-wire`)


def _req_handoff(handoff: str | None) -> str | None:
    """The request's handoff field: unset (the router's setting) unless one-shot / chunked."""
    return handoff if handoff in ("one-shot", "chunked") else None


def run(args) -> int:
    from pddjax.workload import TokenBuilder, config_dict, generate, read_trace, summarize, write_trace

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if mode_pipeline(m) is None]
    if bad or not modes:
        raise UserError(f"unknown mode {bad[0] if bad else '(none)'}: use {', '.join(MODES)}")
    if args.plots:
        from serving.bench.serve import plots as bench_serve_plots

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
    if args.peer:
        return peer_command.run(args, trace, trace_seed, mcfg, summary)
    if args.openai_url:
        from serving.bench.serve import openai_driver

        return openai_driver.run(args, trace, trace_seed, mcfg.vocab_size, summary)
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
                                   "kv_bytes_to_main": r.kv_bytes_to_main, "error": r.error}
                                  for r in recs] for m, recs in per_mode.items()}
        return result

    for mode in modes:
        workdir = tempfile.mkdtemp(prefix=f"pddjax-bench-{mode}-")
        stack_cfg = stack_config(args, mcfg, drc=(mode != "pdd-drc-off"), kv_wire=kv_wire_of(mode))
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
            counters["cpu_before"] = stack.cpu_s()
            counters["t_before"] = time.time()
            counters["compiles_before"] = compiles.read(stack.engines())
            return stack.router

        try:
            link.mbps, link.latency_ms = 0.0, 0.0  # warm-up and history on an unshaped line
            if not args.no_warmup:
                pipes = ["pdd"] if mode_pipeline(mode) == "auto" else [mode_pipeline(mode)]  # pdd: P, RLD, MD
                # the first stack compiles (3 sessions: decode batch buckets 1, 2 and 4); later
                # ones find the executables in the persistent cache
                warmup(stack.router, pipes, mcfg.vocab_size, prompt_len, _req_handoff(args.handoff),
                       sessions=3 if mode == modes[0] else 2)
            builder = TokenBuilder(trace_seed, mcfg.vocab_size)
            t_hist = time.monotonic()
            records, wall, history, history_wall = replay(stack.router, trace, mode_pipeline(mode), builder,
                                                          _req_handoff(args.handoff), mode,
                                                          before_measure=measure_from_here)
            after = link.stats()
            cpu_after = stack.cpu_s()
            compiles_end = compiles.read(stack.engines())
            window = [round(counters["t_before"], 3), round(time.time(), 3)]
            pids = {c.role: c.proc.pid for c in stack.children}
        finally:
            stack.close()
        shutil.rmtree(workdir, ignore_errors=True)
        per_mode[mode] = records
        before = counters["before"]
        figures[mode] = mode_figures(records, wall, after["bytes_a_to_b"] - before["bytes_a_to_b"],
                                     after["bytes_b_to_a"] - before["bytes_b_to_a"], kv_wire=kv_wire_of(mode))
        figures[mode]["stack_s"] = round(t_hist - t0, 1)  # start + warm-up
        figures[mode]["history_s"] = round(history_wall, 1)  # the history turns themselves
        figures[mode]["restart_s"] = round(time.monotonic() - t_hist - wall - history_wall, 1)  # router restart
        figures[mode]["history_errors"] = sum(r.error is not None for r in history)
        # CPU each process used during the measured phase (the simulator's host model checks against it)
        figures[mode]["cpu_s"] = {k: round(v - counters["cpu_before"].get(k, 0.0), 2) for k, v in cpu_after.items()}
        figures[mode]["window"], figures[mode]["pids"] = window, pids  # for PDDJAX_STEP_LOG timelines
        # step compiles after each engine service reported SERVING (warm-up included: the target is
        # none at all), and those of the measured phase alone
        figures[mode]["compiles_after_ready"] = compiles.after_ready(stack.compiles_at_ready, compiles_end)
        figures[mode]["compiles_measured"] = compiles.during(counters.get("compiles_before", {}), compiles_end)
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
        from serving.bench.serve import plots as bench_serve_plots

        for path in bench_serve_plots.plot(result, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0
