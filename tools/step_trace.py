"""Where one engine step's time goes: the forward of a stated shape, traced with `jax.profiler`,
its XLA thunks summed per step and named with what they compute (issue 34, item 2).

Builds the paged forward of a model (weights as `PagedEngine` holds them: fused projections,
on the device) for one (T, B, MP, Q) shape at a context (every row `ctx` tokens of KV plus its
new ones, pages scattered over the pool as a loaded engine's are), runs it `--reps` times under
the profiler, and prints per step: the wall time, then each thunk (a fusion, a library dot, the
layer loop) with its milliseconds, calls, and the shape it writes and what it reads (from the
compiled HLO), largest first. Names ending in `ynn_fusion` are YNNPACK's matrix products,
`*gather*` / `copy_bitcast_fusion` over the pool the page gathers, `dynamic-slice*` the layer
scan's weight-slice copies.

    python -m tools.step_trace [--model smollm2-135m] [--shape 32,32,32,1] [--context 256]
                               [--num-pages 1024] [--reps 3] [--top 25] [--attention xla|native]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.step_trace", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--shape", default="32,32,32,1", help="T,B,MP,Q: tokens, rows, page-table width, longest row")
    ap.add_argument("--context", type=int, default=256, help="KV tokens each row has before its new ones")
    ap.add_argument("--num-pages", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--attention", default="xla", choices=["xla", "native"],
                    help="the paged attention the forward runs (native: the CPU kernel, one custom-call thunk)")
    args = ap.parse_args(argv)
    T, B, MP, Q = (int(x) for x in args.shape.split(","))
    pages = -(-(args.context + T // B) // args.page_size)  # each row's
    if T % B or T // B > Q or pages > MP or (B - 1) * MP + pages > args.num_pages - 1:
        raise SystemExit("step_trace: the shape must hold B rows of T / B tokens (<= Q) after --context tokens "
                         "each in MP pages, and the pool the B rows' pages (rows MP pages apart, page 0 scratch)")

    from pddjax.model.jax_setup import configure

    configure()
    import jax

    from pddjax.kv.pool import KVPool
    from pddjax.model.paged import forward_paged
    from pddjax.model.registry import load_model
    from pddjax.model.weights import for_engine, in_panels

    model = load_model(args.model)
    cfg = model.config
    weights = jax.device_put(for_engine(model.weights, one_device=True))
    pool = KVPool.zeros(cfg.num_layers, cfg.num_kv_heads, args.num_pages, args.page_size, cfg.head_dim, "float32")
    batch = _batch(T, B, MP, args.context, args.page_size, args.num_pages, cfg.vocab_size)
    if args.attention == "native":
        from pddjax.model.attention import native_paged

        if not native_paged.available():
            raise SystemExit("step_trace: the native attention could not be built here (the log says why)")
        weights = in_panels(weights)  # as a native engine holds them (steps of few tokens read them in place)
    fwd = jax.jit(lambda w, b, p: forward_paged(w, cfg, b, p, max_q_len=Q, impl=args.attention), donate_argnums=(2,))
    compiled = fwd.lower(weights, batch, pool).compile()
    state = [pool]

    def step():
        logits, state[0] = compiled(weights, batch, state[0])
        logits.block_until_ready()

    step()
    walls = []
    with tempfile.TemporaryDirectory(prefix="pddjax-step-trace-") as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(args.reps):
                t0 = time.perf_counter()
                step()
                walls.append(time.perf_counter() - t0)
        thunks = _thunk_times(folder, args.reps)
    shapes = _fusion_shapes(compiled.as_text())
    print(f"{args.model} forward [{T}, {B}, {MP}, {Q}] at context {args.context}: "
          f"{1e3 * min(walls):.1f} ms a step (best of {args.reps}); thunks per step:")
    for name, (ms, calls) in thunks[:args.top]:
        out, reads = shapes.get(name, ("(the layer loop, its own time)", "") if name.startswith("while") else ("", ""))
        print(f"  {ms:8.2f} ms  x{calls:<4d} {name:34s} {out:28s} {reads}")
    return 0


def _batch(T, B, MP, context, page_size, num_pages, vocab):
    """B rows of T / B new tokens after `context` tokens each, pages drawn at random (page 0 is scratch)."""
    import numpy as np

    from pddjax.model.paged import PackedBatch

    rng = np.random.default_rng(0)
    q = T // B
    kv = np.full(B, context + q, np.int32)
    tables = np.zeros((B, MP), np.int32)
    free = rng.permutation(np.arange(1, num_pages))
    for r in range(B):
        n = -(-int(kv[r]) // page_size)
        tables[r, :n] = free[r * MP:r * MP + n]
    pos = np.concatenate([np.arange(kv[r] - q, kv[r]) for r in range(B)]).astype(np.int32)
    row = np.repeat(np.arange(B), q)
    cu = np.arange(B + 1, dtype=np.int32) * q
    return PackedBatch(rng.integers(3, vocab, T).astype(np.int32), pos, tables[row, pos // page_size],
                       (pos % page_size).astype(np.int32), cu, kv, tables, cu[1:] - 1)


def _thunk_times(folder: str, reps: int) -> list[tuple[str, tuple[float, int]]]:
    """[(thunk name, (ms per step, calls per step))], largest first, from the perfetto trace."""
    path = glob.glob(os.path.join(folder, "**", "*.json.gz"), recursive=True)[0]
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and "dur" in e and not name.startswith("$") and "::" not in name \
                and not name.startswith(("PjitFunction", "end:")):
            total[name] += e["dur"]
            calls[name] += 1
    return [(n, (t / reps / 1e3, calls[n] // reps)) for n, t in total.most_common()]


def _fusion_shapes(hlo: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (the shape it writes, its operands)} of the compiled module's fusions,
    library calls and loops."""
    out = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) (?:fusion|custom-call|dot|while|copy)\(([^)]*)\)", line)
        if m:
            out[m.group(1)] = (m.group(2), re.sub(r"%", "", m.group(3))[:80])
    return out


if __name__ == "__main__":
    raise SystemExit(main())
