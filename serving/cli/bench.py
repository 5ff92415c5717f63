"""`pddjax bench ...`: benchmarks that print figures (never timed unit tests).

- `bench serve` (serving/bench/serve/command.py): the agentic trace through pdd, pd-cross, pd-local.
- `bench serving` (serving/bench/load/command.py): N concurrent streams per pipeline vs the engine alone.
- `bench speculative` (serving/bench/speculative/command.py): prompt-lookup speculation on vs off.
- `bench kv-quality` (serving/bench/kv/quality.py): each KV wire format's cost, teacher-forced.
- `bench kv-tp` (serving/bench/kv/tp.py): KV bytes moved per token between tensor-parallel degrees.
- `bench reference`: real-model load time (GGUF cold vs the weights cache), prefill tokens/s at a
  512-token prompt, decode tokens/s at batch 1, all through the monolithic reference engine.
"""

from __future__ import annotations

import statistics
import tempfile
import time

from pddjax.errors import UserError
from pddjax.report import write_figures


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (print figures, optionally write JSON)")
    bsub = p.add_subparsers(dest="bench", required=True)
    r = bsub.add_parser("reference", help="load time, prefill and decode speed of the reference engine")
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    r.add_argument("--prompt-tokens", type=int, default=512)
    r.add_argument("--decode-tokens", type=int, default=64)
    r.add_argument("--json", help="also write the figures to this file")
    r.set_defaults(func=run_reference)
    from serving.bench.kv import handoff
    from serving.bench.kv import quality as kv_quality
    from serving.bench.kv import tp as kv_tp
    from serving.bench.load import command as serving_load
    from serving.bench.serve import command as serve
    from serving.bench.speculative import command as speculative
    from serving.bench.startup import command as startup
    from serving.cli import bench_engine

    for module in (bench_engine, handoff, serve, kv_quality, kv_tp, serving_load, speculative, startup):
        module.register(bsub)


def run_reference(args) -> int:
    import os

    from pddjax import env
    from pddjax.model.jax_setup import configure

    configure()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pddjax.engines import reference as ref
    from pddjax.model.dense import DenseKV
    from pddjax.model.registry import load_model
    from pddjax.model.sampling_params import SamplingParams

    figures: dict = {"model": args.model, "dtype": args.dtype, "backend": jax.default_backend()}
    if args.model != "tiny":  # cold (GGUF) then warm (weights cache) start, in a scratch cache
        with tempfile.TemporaryDirectory() as d:
            old = os.environ.get(env.CACHE_DIR.name)
            os.environ[env.CACHE_DIR.name] = d
            try:
                cold = load_model(args.model)
                warm = load_model(args.model)
            finally:
                os.environ.pop(env.CACHE_DIR.name) if old is None else os.environ.__setitem__(env.CACHE_DIR.name, old)
        figures["load_s"] = {"gguf": round(cold.load_seconds, 2), "orbax_cache": round(warm.load_seconds, 2)}
        model = warm
    else:
        model = load_model(args.model)
    cfg = model.config
    eng = ref.ReferenceEngine(cfg, model.weights, args.dtype)
    n = args.prompt_tokens
    if n + args.decode_tokens > cfg.max_context:
        raise UserError("prompt plus decode tokens exceed the model context")
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, n).astype(np.int32)
    tokens = jnp.asarray(prompt[None])
    cache_len = ref.bucket(n + args.decode_tokens)
    sp = ref._sampling_arrays(SamplingParams(), 0)
    times = []
    for _ in range(4):  # first is compile
        cache = DenseKV.zeros(cfg, 1, cache_len, eng.dtype)
        t0 = time.perf_counter()
        tok, _, cache = ref._prefill(eng.weights, cfg, tokens, jnp.int32(n), cache, *sp)
        tok.block_until_ready()
        times.append(time.perf_counter() - t0)
    figures["prefill_tokens_per_s"] = round(n / statistics.median(times[1:]), 1)
    step_times = []
    for i in range(args.decode_tokens):
        t0 = time.perf_counter()
        tok, _, cache = ref._decode(eng.weights, cfg, tok, jnp.int32(n + i), cache, *sp)
        tok.block_until_ready()
        step_times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(step_times[2:])
    figures["decode_ms_batch1"] = round(ms, 2)
    figures["decode_tokens_per_s_batch1"] = round(1e3 / ms, 1)
    write_figures(figures, args.json)
    return 0
