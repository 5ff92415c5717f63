"""Two attention implementations side by side in one process: the paged forward of each step shape
compiled once per implementation, steps interleaved, the median per side, and whether the two
agree (largest logit difference, the same argmax per row).

    python -m tools.attention_ab [--model smollm2-135m] [--impls xla,native] [--context 256]
        [--shapes 1,1,32,1 8,8,32,1 16,16,32,1 32,32,32,1 20,4,32,5 64,1,32,64 96,32,32,64 512,1,48,512]
        [--reps 9] [--json F]

A shape is T,B,MP,Q (tokens, rows, page-table width, longest row): B rows of T / B new tokens
after --context tokens of KV each (a shape whose rows are --prefill-at tokens or longer starts
from an empty context: a prefill). The KV pool holds random values (N(0, 1)), so attention is
not trivially uniform. `native@K` is the native attention with the products read in place for
steps of up to K tokens only (`layers.IN_PLACE_MAX_TOKENS`; `native@1` keeps XLA's products from
two tokens on). Run it on a quiet machine, under `nice -n -20`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

DEFAULT_SHAPES = "1,1,32,1 8,8,32,1 16,16,32,1 32,32,32,1 20,4,32,5 64,1,32,64 96,32,32,64 512,1,48,512"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.attention_ab", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--impls", default="xla,native")
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES.split())
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill-at", type=int, default=512)
    ap.add_argument("--num-pages", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    impls = args.impls.split(",")

    from pddjax.model.jax_setup import configure

    configure()
    import jax
    import numpy as np

    from pddjax.kv.pool import KVPool
    from pddjax.model import layers
    from pddjax.model.paged import forward_paged
    from pddjax.model.registry import load_model
    from pddjax.model.weights import for_engine, in_panels
    from tools.step_trace import _batch

    model = load_model(args.model)
    cfg = model.config
    weights = jax.device_put(for_engine(model.weights, one_device=True))
    panels = in_panels(weights)  # the native sides' weights, as a native engine holds them
    shape = (cfg.num_layers, cfg.num_kv_heads, args.num_pages, 16, cfg.head_dim)
    results = []
    for text in args.shapes:
        T, B, MP, Q = (int(x) for x in text.split(","))
        batch = _batch(T, B, MP, 0 if Q >= args.prefill_at else args.context, 16, args.num_pages, cfg.vocab_size)
        sides = {}
        for impl in impls:
            pool = KVPool(jax.random.normal(jax.random.key(0), shape), jax.random.normal(jax.random.key(1), shape))
            name, _, in_place = impl.partition("@")  # native@K: products read in place up to K tokens
            fwd = jax.jit(lambda w, b, p, name=name, Q=Q: forward_paged(w, cfg, b, p, max_q_len=Q, impl=name),
                          donate_argnums=(2,))
            default = layers.IN_PLACE_MAX_TOKENS
            layers.IN_PLACE_MAX_TOKENS = int(in_place) if in_place else default
            try:
                w = panels if name == "native" else weights
                sides[impl] = [fwd.lower(w, batch, pool).compile(), pool, [], None, w]
            finally:
                layers.IN_PLACE_MAX_TOKENS = default
        ms = interleaved(sides, batch, args.reps)
        base, other = sides[impls[0]][3], sides[impls[-1]][3]
        row = {"shape": [T, B, MP, Q], "ms": {k: round(v, 2) for k, v in ms.items()},
               "ratio": round(ms[impls[-1]] / ms[impls[0]], 3),
               "max_logit_diff": float(np.abs(base - other).max()),
               "argmax_same": bool((base.argmax(-1) == other.argmax(-1)).all())}
        results.append(row)
        print(f"[{T}, {B}, {MP}, {Q}] " + "  ".join(f"{k} {v:.1f} ms" for k, v in ms.items())
              + f"  {impls[-1]}/{impls[0]} {row['ratio']:.2f}  max |logit diff| {row['max_logit_diff']:.1e}"
              + f"  argmax same {row['argmax_same']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "context": args.context, "impls": impls, "shapes": results}, f, indent=1)
    return 0


def interleaved(sides: dict[str, list], batch, reps: int) -> dict[str, float]:
    """`reps` rounds of one step of each side in turn -> {side: median ms}. A side is [compiled
    forward, its pool (donated: replaced by each step's), step seconds so far, the last step's
    logits, the weights it takes]; the logits are left in it for the caller to compare."""
    import numpy as np

    for _ in range(reps):
        for side in sides.values():
            t0 = time.perf_counter()
            logits, side[1] = side[0](side[4], batch, side[1])
            side[3] = np.asarray(logits)
            side[2].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(side[2]) for name, side in sides.items()}


if __name__ == "__main__":
    raise SystemExit(main())
