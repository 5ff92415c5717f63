"""What each member of an engine's stated step-shape set costs, and which ones a cheaper-to-keep
neighbour could absorb (issue 31, item 4: a bucket set chosen by measurement).

Builds the whole set of the engine table (the real model's default stack P / MD table unless
told), times each member's step (forward + sampler, an all-padding batch: the cost of a shape
does not depend on what its tokens are) as the median of `--repeats` after one warm-up call,
then, for each member, finds the cheapest other member that covers it (every dimension at
least as large): if that neighbour costs within `--within` of the member, a step of the
member's shape could pad into it at that price, and the member is a candidate to drop.

    python -m tools.member_costs [--model smollm2-135m] [--num-pages 512] [--max-rows 16]
                                 [--repeats 5] [--within 0.05] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.member_costs", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-pages", type=int, default=512)
    ap.add_argument("--max-rows", type=int, default=16)
    ap.add_argument("--max-step-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--within", type=float, default=0.05)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from pddjax.model.jax_setup import configure

    configure()
    from pddjax.engines import buckets, precompile, step
    from pddjax.engines.engine_config import EngineConfig
    from pddjax.engines.paged_engine import PagedEngine
    from pddjax.model.registry import load_model

    m = load_model(args.model)
    cfg = EngineConfig(num_pages=args.num_pages, max_rows=args.max_rows, max_step_tokens=args.max_step_tokens,
                       attention="xla")
    eng = PagedEngine(m.config, m.weights, m.fingerprint, cfg)
    t0 = time.perf_counter()
    eng.precompile("all")
    print(f"{len(eng.stated)} members built in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    costs = {}
    for shape in eng.stated:
        batch, sampling = precompile.dummy_batch(shape)
        times = []
        for i in range(args.repeats + 1):
            w = time.perf_counter()
            out = step.run(eng.weights, eng.cfg, batch, eng.pool, sampling, None, max_q_len=shape[3],
                           impl=cfg.attention, greedy=True)
            out.tokens.block_until_ready()
            eng.pool = out.pool
            if i:
                times.append(time.perf_counter() - w)
        costs[shape] = statistics.median(times) * 1e3
    rows = []
    for shape, ms in sorted(costs.items(), key=lambda kv: kv[1]):
        others = [(c, s) for s, c in costs.items() if s != shape and buckets.covers(s, *shape[:3], shape[3])]
        near = min(others) if others else None
        rows.append({"shape": list(shape), "ms": round(ms, 2), "neighbour": list(near[1]) if near else None,
                     "neighbour_ms": round(near[0], 2) if near else None,
                     "drop": bool(near and near[0] <= ms * (1 + args.within))})
    print(f"{'T':>4} {'B':>3} {'MP':>4} {'Q':>4} {'ms':>9}   cheapest cover        ms      drop")
    for r in rows:
        nb = "-" if r["neighbour"] is None else str(tuple(r["neighbour"]))
        print(f"{r['shape'][0]:4d} {r['shape'][1]:3d} {r['shape'][2]:4d} {r['shape'][3]:4d} {r['ms']:9.2f}   "
              f"{nb:20s} {r['neighbour_ms'] or 0:8.2f}  {'yes' if r['drop'] else ''}")
    dropped = [r for r in rows if r["drop"]]
    print(f"{len(dropped)} of {len(rows)} members have a covering neighbour within {args.within:.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "config": vars(args), "members": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
