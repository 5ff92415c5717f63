"""The RLD -> MD switch as the user sees it, per handoff setting, side by side in one run.

One stack (P, RLD, MD, router as processes; MD behind the emulated WAN), cold prompts sent with
pipeline `pdd`, one at a time (the gap itself) and then in a burst (the gap under load), for
each handoff setting: one-shot, and chunked with the router's `handoff_threshold` at each given
value (the router is restarted per setting; P's and MD's caches are not reused: every prompt is
new). Per setting: the handoff gap (last RLD token -> first MD token, as the client receives
them) p50 / p99 / max, the relay's inter-token interval p50 / p99 (what the gap should look
like), the longest pause between two tokens, e2e, and the handoff chunks. Prints JSON.

  .venv/bin/python -m tools.handoff_gap --model smollm2-135m --settings one-shot,chunked:64,chunked:4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time

import numpy as np

from serving.bench.serve.stack import BenchStack
from serving.client import Client, make_request
from serving.pb import common_pb2
from serving.stack.up import write_json


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 1) if xs else None


def one(router: str, prompt: list[int], max_tokens: int, handoff: str, seed: int) -> dict:
    """One pdd request: per-message receive times and sources -> the switch's figures."""
    times: list[tuple[float, int]] = []  # (receive time, source) per message with tokens
    client = Client(router)
    try:
        t0 = time.perf_counter()
        res = client.generate(make_request(prompt, max_tokens=max_tokens, pipeline="pdd", handoff=handoff,
                                           ignore_eos=True, seed=seed),
                              timeout=600, on_tokens=lambda m: times.append((time.perf_counter(), m.sources[0])))
    finally:
        client.close()
    relay = [t for t, s in times if s == common_pb2.ROLE_RELAY]
    main = [t for t, s in times if s == common_pb2.ROLE_MAIN]
    gaps = [1e3 * (b[0] - a[0]) for a, b in zip(times, times[1:])]
    relay_itl = [1e3 * (b - a) for a, b in zip(relay, relay[1:])]
    return {"gap_ms": 1e3 * (main[0] - relay[-1]) if relay and main else None, "relay_itl_ms": relay_itl,
            "max_pause_ms": max(gaps) if gaps else 0.0, "e2e_ms": 1e3 * (times[-1][0] - t0) if times else 0.0,
            "relay_tokens": res.usage["relay_tokens"], "main_tokens": res.usage["main_tokens"],
            "chunks": res.usage["handoff_chunks"]}


def run_setting(stack: BenchStack, router_cfg: dict, setting: str, prompts: list[list[int]], args) -> dict:
    mode, _, threshold = setting.partition(":")
    write_json(stack.router_cfg, {**router_cfg, "router": {**router_cfg["router"],
                                                            "handoff_threshold": int(threshold or 64)}})
    stack.start_router()
    handoff = "one-shot" if mode == "one-shot" else "chunked"
    alone = [one(stack.router, p, args.max_tokens, handoff, i) for i, p in enumerate(prompts[: args.requests])]
    burst: list[dict] = []
    threads = [threading.Thread(target=lambda p=p, i=i: burst.append(one(stack.router, p, args.max_tokens, handoff, i)))
               for i, p in enumerate(prompts[args.requests:])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {}
    for name, recs in (("alone", alone), ("burst", burst)):
        gaps = [r["gap_ms"] for r in recs if r["gap_ms"] is not None]
        itl = [x for r in recs for x in r["relay_itl_ms"]]
        out[name] = {"requests": len(recs), "handed_off": len(gaps), "gap_p50_ms": _pct(gaps, 50),
                     "gap_p99_ms": _pct(gaps, 99), "gap_max_ms": round(max(gaps), 1) if gaps else None,
                     "relay_itl_p50_ms": _pct(itl, 50), "relay_itl_p99_ms": _pct(itl, 99),
                     "max_pause_ms": round(max(r["max_pause_ms"] for r in recs), 1) if recs else None,
                     "e2e_p50_ms": _pct([r["e2e_ms"] for r in recs], 50),
                     "relay_tokens_mean": round(statistics.mean(r["relay_tokens"] for r in recs), 1) if recs else 0,
                     "chunks_mean": round(statistics.mean(r["chunks"] for r in recs), 2) if recs else 0}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--settings", default="one-shot,chunked:64,chunked:4")
    ap.add_argument("--wan-mbps", type=float, default=100.0)
    ap.add_argument("--wan-latency-ms", type=float, default=20.0)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="one at a time, per setting")
    ap.add_argument("--burst", type=int, default=4, help="then these at once, per setting")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    stack_cfg = {"model": args.model, "platform": "cpu",
                 "engine": {"dtype": "float32", "page_size": 16, "num_pages": 1024, "max_step_tokens": 256},
                 "router": {"handoff": "chunked"}, "wan": {"mbps": args.wan_mbps, "latency_ms": args.wan_latency_ms}}
    rng = np.random.default_rng(0)
    settings = args.settings.split(",")
    n = args.requests + args.burst
    figures: dict = {"config": vars(args), "settings": {}}
    with tempfile.TemporaryDirectory() as workdir:
        stack = BenchStack(stack_cfg, workdir)
        try:
            router_cfg = json.load(open(stack.router_cfg))
            for k, setting in enumerate(settings):
                prompts = [rng.integers(100, 40000, args.prompt_tokens).tolist() for _ in range(n)]
                if k == 0:  # warm-up (prompts of its own): the first requests meet the engines' shapes
                    for _ in range(2):
                        one(stack.router, rng.integers(100, 40000, args.prompt_tokens).tolist(), args.max_tokens,
                            "chunked", 99)
                figures["settings"][setting] = run_setting(stack, router_cfg, setting, prompts, args)
                print(json.dumps({setting: figures["settings"][setting]}), flush=True)
        finally:
            stack.close()
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    from pddjax.env import DIE_WITH_PARENT

    os.environ.setdefault(DIE_WITH_PARENT.name, "1")
    raise SystemExit(main())
