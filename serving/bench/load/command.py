"""`pddjax bench serving`: N concurrent Generate streams sent at once through each pipeline, with
the engine alone beside it in the same run (issue 18), at each `--stream-interval` K (tokens per
streamed message, side by side; a cell's key is "N" at K = 1, "N@K" otherwise: `cell`).

One stack (`BenchStack`: P, RLD, MD, router as processes, MD behind the emulated WAN; default
1000 Mb/s, 5 ms one way, no jitter, so pdd hands off to MD within a 64-token output), one bench
process. Per pipeline (pd-local, pd-cross, pdd: the request's pipeline, never auto) and stream
count N (--streams), N streams are started together over grpc.aio (one channel per 16 streams):
distinct random `--prompt-tokens` prompts, `--max-tokens` outputs, ignore_eos, greedy. Then the
burst mode: `--burst` streams of `--burst-tokens` through each of `--burst-pipelines`, more than
the pools hold at once (default: 64 x 10 pages and 256 x 10 against 511 per tier), so they queue
for pages (pd-local on RLD; pdd on MD first: the router reserves MD before RLD, and RLD frees its
pages at the handoff): all must complete token-exact, none refused; the router's
`pddjax_router_page_wait_seconds` histogram is read from its /metrics before and after.

Figures per burst: figures.py (tokens/s, TTFT, ITL, max gap, e2e, exact). The engine
alone = a PagedEngine in this process with the relay's engine config, pinned to the relay's
cores like RLD and measured right before the N-stream bursts (the same ambient load; `load_1m`
beside each figure): N rows added at once, `decode_tokens_per_s` = tokens decoded after every
row has its first one / that time, `first_tokens_s` = until every row has its first one,
`burst_tokens_per_s` = all output tokens / the whole time (this engine prefills and decodes at
once, unlike P and RLD); the ratios divide the serving figure by `decode_tokens_per_s` (the
issue's target), and pdd by pd-local.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from pddjax.errors import UserError
from serving.bench.load.figures import (
    Stream,
    burst_figures,
    counts_delta,
    cpu_delta,
    explain_mismatches,
    failures_delta,
    markdown,
    page_wait_delta,
    per_token,
    ratio,
    scrape_router,
)
from serving.bench.serve import compiles
from serving.bench.serve.stack import BenchStack, cluster_cpus

PIPELINES = ("pd-local", "pd-cross", "pdd")
WAN = {"mbps": 1000.0, "latency_ms": 5.0, "jitter_ms": 0.0}
STREAMS_PER_CHANNEL = 16
PAGE_SIZE = 16


def register(bsub) -> None:
    p = bsub.add_parser("serving", help="concurrent streams per pipeline against the engine alone, and a queued burst")
    p.add_argument("--model", default="tiny")
    p.add_argument("--pipelines", default=",".join(PIPELINES))
    p.add_argument("--streams", default="16,32,64", help="concurrent streams per burst (comma list)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream-interval", default="1", help="tokens per streamed message (comma list: side by side)")
    p.add_argument("--handoff", choices=("one-shot", "chunked"),
                   help="pdd's handoff mode per request (default: the router's [router] handoff, auto)")
    p.add_argument("--keep-main", action="store_true",
                   help="pdd: never give MD up ([router] give_up_main = false: every request hands off)")
    p.add_argument("--interval-at-router", action="store_true",
                   help="the router groups the stream interval, RLD / MD send every step's tokens "
                        "([router] interval_at_source = false: the side-by-side of where it is kept)")
    p.add_argument("--burst", default="64,256", help="queued-burst stream counts ('' = none)")
    p.add_argument("--burst-tokens", type=int, default=128)
    p.add_argument("--burst-pipelines", default="pd-local,pdd")
    p.add_argument("--num-pages", type=int, default=512, help="KV pages of every engine (page 0 is scratch)")
    p.add_argument("--max-rows", type=int, help="rows per engine step (default: the largest --streams)")
    p.add_argument("--max-step-tokens", type=int, default=256, help="token budget of one engine step")
    p.add_argument("--wan-mbps", type=float, default=WAN["mbps"])
    p.add_argument("--wan-latency-ms", type=float, default=WAN["latency_ms"])
    p.add_argument("--no-pin", action="store_true", help="do not pin services (and the engine-only run) to cores")
    p.add_argument("--json", help="also write the figures to this file")
    p.set_defaults(func=run)


def counts(spec: str) -> list[int]:
    try:
        out = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"stream counts must be a comma list of integers, got {spec!r}") from None
    if any(n < 1 for n in out):
        raise UserError(f"stream counts must be positive, got {spec!r}")
    return out


def pipeline_list(spec: str) -> list[str]:
    out = [p.strip() for p in spec.split(",") if p.strip()]
    bad = [p for p in out if p not in PIPELINES]
    if bad:
        raise UserError(f"unknown pipeline {bad[0]}: use {', '.join(PIPELINES)}")
    return out


def stack_config(args) -> dict:
    engine = {"dtype": "float32", "page_size": PAGE_SIZE, "num_pages": args.num_pages,
              "max_step_tokens": args.max_step_tokens, "max_rows": args.max_rows, "prefix_cache": True}
    return {"model": args.model, "platform": "cpu", "engine": engine,
            "router": {"wan_mbps_prior": args.wan_mbps, "wan_latency_ms_prior": args.wan_latency_ms,
                       "give_up_main": not getattr(args, "keep_main", False),
                       "interval_at_source": not getattr(args, "interval_at_router", False)},
            "wan": {"mbps": args.wan_mbps, "latency_ms": args.wan_latency_ms, "jitter_ms": 0.0}}


def make_prompts(tag: int, n: int, length: int, vocab: int) -> list[list[int]]:
    """n distinct prompts (seeded by `tag`, so each burst has its own: no prefix-cache hits)."""
    rng = np.random.default_rng([18, tag])
    return [rng.integers(16, vocab, length).tolist() for _ in range(n)]


# ---- this process's JAX work: the reference outputs and the engine alone ---------------
class Pinned:
    """This thread (and the XLA threads it starts) on `cpus` while inside; restored after."""

    def __init__(self, cpus):
        self.cpus, self.old = cpus, None

    def __enter__(self):
        if self.cpus:
            self.old = os.sched_getaffinity(0)
            os.sched_setaffinity(0, set(self.cpus))

    def __exit__(self, *exc):
        if self.old:
            os.sched_setaffinity(0, self.old)


def reference_outputs(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pddjax.engines.reference import ReferenceEngine
    from pddjax.model.sampling_params import GREEDY

    ref = ReferenceEngine(model.config, model.weights)
    return [ref.generate(p, GREEDY, max_tokens, stop_ids=()).token_ids for p in prompts]


class EngineAlone:
    """N rows decoding together in a PagedEngine of the relay's config, measured on the relay's
    cores right before the streams of the same N (the same ambient load): a warm-up pass (the
    same shapes), then the measured one, each with its own prompts (no prefix-cache hit)."""

    def __init__(self, model, ecfg, args, vocab: int, cpus):
        from pddjax.engines.paged_engine import PagedEngine

        self.model = model  # also the reference of explain_mismatches
        self.eng = PagedEngine(model.config, model.weights, model.fingerprint, ecfg)
        self.args, self.vocab, self.cpus, self.runs = args, vocab, cpus, 0

    def measure(self, n: int) -> dict:
        with Pinned(self.cpus):
            self._once(n)
            got = self._once(n)
        self.eng.check_integrity()
        return {**got, "load_1m": round(os.getloadavg()[0], 2)}

    def _once(self, n: int) -> dict:
        from pddjax.model.sampling_params import GREEDY

        eng, max_tokens = self.eng, self.args.max_tokens
        self.runs += 1
        prompts = make_prompts(500 + self.runs, n, self.args.prompt_tokens, self.vocab)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            eng.add(f"alone{self.runs}-{i}", p, GREEDY, max_tokens, ())
        while any(not s.generated for s in eng.seqs.values()):
            eng.step()
        t1, step_s = time.perf_counter(), []
        while eng.has_work():
            ts = time.perf_counter()
            eng.step()
            step_s.append(time.perf_counter() - ts)
        t2 = time.perf_counter()
        return {"decode_tokens_per_s": round(n * (max_tokens - 1) / (t2 - t1), 1),
                "burst_tokens_per_s": round(n * max_tokens / (t2 - t0), 1), "first_tokens_s": round(t1 - t0, 3),
                "decode_step_ms": round(1e3 * statistics.median(step_s), 3) if step_s else None}


# ---- the client: N streams at once --------------------------------------------------------
async def _one(stub, req, rec: Stream, timeout: float) -> None:
    import grpc

    from serving.pb import common_pb2

    try:
        async for msg in stub.Generate(req, timeout=timeout):
            if msg.token_ids:
                rec.times.append(time.perf_counter())
                rec.sizes.append(len(msg.token_ids))
                rec.tokens.extend(msg.token_ids)
                rec.main_tokens += sum(s == common_pb2.ROLE_MAIN for s in msg.sources)
    except grpc.aio.AioRpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"


async def _burst(router: str, reqs, timeout: float) -> tuple[float, list[Stream]]:
    from serving import rpc
    from serving.pb import router_pb2_grpc

    channels = [rpc.channel(router) for _ in range(max(1, math.ceil(len(reqs) / STREAMS_PER_CHANNEL)))]
    try:
        stubs = [router_pb2_grpc.RouterStub(c) for c in channels]
        for c in channels:
            await c.channel_ready()
        recs = [Stream() for _ in reqs]
        t0 = time.perf_counter()
        await asyncio.gather(*(_one(stubs[i % len(stubs)], r, recs[i], timeout) for i, r in enumerate(reqs)))
        return t0, recs
    finally:
        for c in channels:
            await c.close()


def burst_requests(prompts, max_tokens: int, pipeline: str, tag: str, interval: int = 1,
                   handoff: str | None = None) -> list:
    """The GenerateRequests of one burst: greedy, ignore_eos, `interval` tokens a message, and
    pdd's handoff mode (None: the router's `[router] handoff`)."""
    from serving.client import make_request

    reqs = [make_request(p, max_tokens=max_tokens, pipeline=pipeline, ignore_eos=True, request_id=f"{tag}-{i}",
                         handoff=handoff) for i, p in enumerate(prompts)]
    for r in reqs if interval > 1 else ():
        r.stream_interval = interval
    return reqs


def send_burst(router: str, prompts, max_tokens: int, pipeline: str, tag: str,
               timeout: float = 600.0, interval: int = 1, handoff: str | None = None) -> tuple[float, list[Stream]]:
    """All streams started at once (`interval` tokens per message) -> (start time, per-stream records)."""
    return asyncio.run(_burst(router, burst_requests(prompts, max_tokens, pipeline, tag, interval, handoff), timeout))


def cell(n: int, interval: int) -> str:
    """A result's key for N streams at a stream interval: "64" at 1 token a message (as before), "64@8" at 8."""
    return str(n) if interval == 1 else f"{n}@{interval}"


# ---- the command -----------------------------------------------------------------------
def run(args) -> int:
    from pddjax.model.config import NAMED_CONFIGS

    if args.model not in NAMED_CONFIGS:
        raise UserError(f"bench serving runs a named model ({', '.join(NAMED_CONFIGS)}), got {args.model!r}")
    pipelines, burst_pipelines = pipeline_list(args.pipelines), pipeline_list(args.burst_pipelines)
    if not pipelines:
        raise UserError("give at least one pipeline (--pipelines)")
    streams, bursts, intervals = counts(args.streams), counts(args.burst), counts(args.stream_interval)
    if not intervals:
        raise UserError("give at least one stream interval (--stream-interval)")
    if not streams:
        raise UserError("give at least one stream count (--streams)")
    args.max_rows = args.max_rows or max(streams)
    mcfg = NAMED_CONFIGS[args.model]
    need = max(streams) * -(-(args.prompt_tokens + args.max_tokens) // PAGE_SIZE)
    if need > args.num_pages - 1:
        raise UserError(f"{max(streams)} streams need {need} KV pages at once, more than --num-pages "
                        f"{args.num_pages} holds (page 0 is scratch): the throughput bursts must not queue")
    for n_tok in (args.max_tokens, *([args.burst_tokens] if bursts else [])):
        if args.prompt_tokens + n_tok > mcfg.max_context:
            raise UserError(f"{args.prompt_tokens} + {n_tok} tokens do not fit the model context ({mcfg.max_context})")
    cfg = stack_config(args)
    cpus = {} if args.no_pin else cluster_cpus()
    result: dict = {"version": 1, "model": args.model, "stack": cfg, "cpus": cpus or None, "handoff": args.handoff,
                    "reference": "ReferenceEngine (monolithic, dense cache), greedy, no stop ids",
                    "load_avg": {"before": [round(x, 2) for x in os.getloadavg()]}, "engine": {}, "serving": {},
                    "ratios": {}, "burst": {}}
    plan = [(p, n, i, make_prompts(10 * k + j + 10_000 * (i - 1), n, args.prompt_tokens, mcfg.vocab_size))
            for k, p in enumerate(pipelines) for j, n in enumerate(streams) for i in intervals]
    burst_plan = [(p, n, make_prompts(1000 + 10 * k + j, n, args.prompt_tokens, mcfg.vocab_size))
                  for k, p in enumerate(burst_pipelines) for j, n in enumerate(bursts)]
    t_start = time.monotonic()
    print("bench serving: reference outputs and the engine alone ...", file=sys.stderr, flush=True)
    with Pinned(cpus.get("relay")):
        from pddjax.engines.engine_config import EngineConfig
        from pddjax.model.jax_setup import configure
        from pddjax.model.registry import load_model

        configure()
        model = load_model(args.model)
        refs = {(p, n, i): reference_outputs(model, ps, args.max_tokens) for p, n, i, ps in plan}
        burst_refs = {(p, n): reference_outputs(model, ps, args.burst_tokens) for p, n, ps in burst_plan}
        alone = EngineAlone(model, EngineConfig(**cfg["engine"]), args, mcfg.vocab_size, cpus.get("relay"))
        for n in streams:  # compiles its shapes now
            alone.measure(n)
    result["setup_s"] = {"reference_and_engine": round(time.monotonic() - t_start, 1)}
    with tempfile.TemporaryDirectory(prefix="pddjax-bench-serving-") as workdir:
        t0 = time.monotonic()
        stack = BenchStack(cfg, workdir, pin=not args.no_pin)
        try:
            result["setup_s"]["stack"] = round(time.monotonic() - t0, 1)
            measure(args, stack, alone, streams, plan, refs, burst_plan, burst_refs, result)
        finally:
            stack.close()
    result["load_avg"]["after"] = [round(x, 2) for x in os.getloadavg()]
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    print(markdown(result))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def measure(args, stack, alone, streams, plan, refs, burst_plan, burst_refs, result) -> None:
    from pddjax.model.config import NAMED_CONFIGS

    vocab = NAMED_CONFIGS[args.model].vocab_size
    for k, p in enumerate(dict.fromkeys(p for p, _, _, _ in plan)):  # unmeasured: connections, probe, handoffs
        _, recs = send_burst(stack.router, make_prompts(900 + k, 4, args.prompt_tokens, vocab), 8, p, f"warm-{p}")
        if any(r.error for r in recs):
            raise UserError(f"the {p} warm-up failed: {next(r.error for r in recs if r.error)}")
    engines = stack.engines()
    for p, n, i, prompts in sorted(plan, key=lambda x: streams.index(x[1])):  # the engine alone first, per N
        if str(n) not in result["engine"]:
            print(f"bench serving: the engine alone, {n} rows ...", file=sys.stderr, flush=True)
            result["engine"][str(n)] = alone.measure(n)
        print(f"bench serving: {p} x {n} streams, {i} tokens a message ...", file=sys.stderr, flush=True)
        c0, cpu0, m0 = compiles.read(engines), stack.cpu_s(), scrape_router(stack.router_child.metrics)
        t0, recs = send_burst(stack.router, prompts, args.max_tokens, p, f"{p}-{n}-{i}", interval=i,
                              handoff=args.handoff)
        handoffs = counts_delta(m0, scrape_router(stack.router_child.metrics), "handoffs")
        fig = burst_figures(t0, recs, refs[(p, n, i)])
        fig["stream_interval"], fig["handoffs"] = i, handoffs
        explain_mismatches(fig, alone.model, prompts)
        fig["cpu_s"], fig["compiles"] = cpu_delta(cpu0, stack.cpu_s()), compiles.during(c0, compiles.read(engines))
        fig["cpu_us_per_token"] = per_token(fig["cpu_s"], fig["output_tokens"])  # beside the engine alone's 1e6 / tok/s
        fig["load_1m"] = round(os.getloadavg()[0], 2)
        key = cell(n, i)
        result["serving"].setdefault(p, {})[key] = fig
        result["ratios"].setdefault(p, {})[key] = ratio(fig["tokens_per_s"],
                                                        result["engine"][str(n)]["decode_tokens_per_s"])
    serving = result["serving"]
    if "pdd" in serving and "pd-local" in serving:
        result["ratios"]["pdd_over_pd_local"] = {n: ratio(f["tokens_per_s"], serving["pd-local"][n]["tokens_per_s"])
                                                 for n, f in serving["pdd"].items()}
    for p, n, prompts in burst_plan:
        print(f"bench serving: burst {p} x {n} streams of {args.burst_tokens} tokens ...", file=sys.stderr, flush=True)
        m0 = scrape_router(stack.router_child.metrics)
        t0, recs = send_burst(stack.router, prompts, args.burst_tokens, p, f"burst-{p}-{n}", handoff=args.handoff)
        m1 = scrape_router(stack.router_child.metrics)
        fig = burst_figures(t0, recs, burst_refs[(p, n)])
        explain_mismatches(fig, alone.model, prompts)
        fig["page_wait"], fig["router_failures"] = page_wait_delta(m0, m1), failures_delta(m0, m1)
        fig["load_1m"] = round(os.getloadavg()[0], 2)
        refused = "RESOURCE_EXHAUSTED"
        fig["refused"] = fig["errors"].get(refused, 0) + fig["router_failures"].get(refused, 0)
        result["burst"].setdefault(p, {})[str(n)] = {"max_tokens": args.burst_tokens, **fig}
