"""`pddjax bench engine`: step latency of the paged engine by batch and by extend length.

decode_ms[b]: one decode step with b sequences at ~256-token contexts (the median of
`--repeats` steps, the better of two rounds: one first, one after everything else, both in
`decode_ms_rounds`); extend_ms[k]: one
extend-decode step of k known tokens for one sequence at a ~256-token context (the RLD
handoff); prefill_tokens_per_s: one 512-token prompt. Whole engine steps are timed (host
batch building included). PDD's premise: extend_ms["64"] is close to decode_ms["1"].

`--tensor-parallel N`: the engine over N devices (on CPU, N fake devices that share the
machine's cores: the step times then show the overhead of the split, not its speed-up), and
`collectives`: the all-reduces, all-gathers, ... in the compiled HLO of the decode step of the
smallest batch and the extend step of the longest extend, counted as written (`static`) and as
run per step (`per_step`: the layer loop's body once per layer).

`machine` and `roofline` (serving/bench/roofline.py): this machine's read bandwidth and matmul
peak, measured before and after the steps (the best of both kept), and every step's floor under
them with `fraction` = measured / floor; the table is printed after the JSON.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from pddjax.errors import UserError
from pddjax.report import write_figures
from serving.bench import roofline

CONTEXT = 256


def register(bsub) -> None:
    p = bsub.add_parser("engine", help="decode / extend / prefill step latency of the paged engine")
    p.add_argument("--model", default="smollm2-135m", help="tiny | smollm2-135m | PATH.gguf")
    p.add_argument("--attention", choices=["xla", "pallas", "native"], default=None, help="default: per backend")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--batches", default="1,8,16,32")
    p.add_argument("--extends", default="1,16,64")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="devices of the engine (CPU: N fake devices sharing the cores: overhead only)")
    p.add_argument("--json", help="write the figures to this file")
    p.set_defaults(func=run)


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(times), 2)


def run(args) -> int:
    from pddjax.model.jax_setup import configure

    if args.tensor_parallel < 1:
        raise UserError(f"--tensor-parallel must be at least 1, got {args.tensor_parallel}")
    configure(devices=args.tensor_parallel)
    import jax

    from pddjax.engines.paged_engine import EngineConfig, PagedEngine
    from pddjax.engines.step import compile_count
    from pddjax.model.attention import default_impl
    from pddjax.model.gguf_meta import GGUFError
    from pddjax.model.registry import ModelNotFound, load_model
    from pddjax.model.sampling_params import SamplingParams
    from serving.engine.grammars import compiler_for

    try:
        model = load_model(args.model)
        batches = [int(x) for x in args.batches.split(",")]
        extends = [int(x) for x in args.extends.split(",")]
    except (ModelNotFound, GGUFError, ValueError) as e:
        raise UserError(str(e)) from None
    cfg = model.config
    impl = args.attention or default_impl()
    rng = np.random.default_rng(0)
    steps_needed = 3 + args.repeats
    decode_budget = max(batches) * CONTEXT // 512 + 2 * steps_needed + 4  # prefill steps decode too
    per_seq = max(CONTEXT + decode_budget, CONTEXT + max(extends) + 2, 512 + 1)
    pages = (max(batches) + 2) * (-(-per_seq // args.page_size))
    ecfg = EngineConfig(dtype=args.dtype, page_size=args.page_size, num_pages=pages + 1, attention=impl,
                        max_step_tokens=512, max_rows=max(max(batches), 1), tensor_parallel=args.tensor_parallel)
    grammar = compiler_for(model)  # None for `tiny` (no tokenizer): no constrained column
    try:
        eng = PagedEngine(cfg, model.weights, model.fingerprint, ecfg, grammar=grammar)
    except ValueError as e:  # a degree the model does not admit, or too few devices
        raise UserError(str(e)) from None
    before_limits = roofline.machine_limits()
    collective_shapes = {}  # "decode" / "extend" -> the step shape whose HLO is counted
    greedy = SamplingParams()

    def prompt(n):
        return rng.integers(3, cfg.vocab_size, n).tolist()

    def prefill_all(ids):
        while eng.has_work() and any(not eng.seqs[i].generated for i in ids):
            eng.step()

    figures = {"model": cfg.name, "dtype": args.dtype, "attention": impl, "backend": jax.default_backend(),
               "page_size": args.page_size, "context": CONTEXT, "decode_ms": {}, "extend_ms": {},
               "tensor_parallel": args.tensor_parallel, "devices": eng.layout.describe()}
    if args.tensor_parallel > 1 and jax.default_backend() == "cpu":
        figures["note"] = (f"{args.tensor_parallel} fake CPU devices share this machine's cores: step times show "
                           "the overhead of the split, not a speed-up")
    for b in batches:
        ids = [f"d{b}-{i}" for i in range(b)]
        for i in ids:
            eng.add(i, prompt(CONTEXT), greedy, decode_budget, ())
        prefill_all(ids)
        eng.step()  # warm-up (compile) for this shape
        collective_shapes.setdefault("decode", eng.last_shape[:4])
        figures["decode_ms"][str(b)] = _median_ms(eng.step, args.repeats)
        for i in ids:
            eng.release(i, cache=False)
    if grammar is not None:
        _constrained(figures, eng, grammar, batches, prompt, prefill_all, decode_budget, args.repeats)
    base = prompt(CONTEXT)  # extend rows sit on a cached 256-token context
    for k in extends:
        sid = f"e{k}"

        def extend_step(sid=sid, k=k, cache=False):
            seq = eng.add(sid, base, greedy, k + 2, ())
            prefill_all([sid])  # computes the uncached tail and samples output position 0
            seq.append_known(1, prompt(k - 1))  # k pending tokens: one extend row
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            collective_shapes["extend"] = eng.last_shape[:4]
            eng.release(sid, cache=cache)
            return dt

        extend_step(cache=True)  # compile + fill the prefix cache
        figures["extend_ms"][str(k)] = round(1e3 * statistics.median(extend_step() for _ in range(args.repeats)), 2)
    sid, n_pre = "prefill", min(512, cfg.max_context - 1)

    def prefill_once():
        eng.add(sid, prompt(n_pre), greedy, 1, (), hold_on_finish=True)
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        eng.release(sid, cache=False)
        return dt

    prefill_once()
    figures["prefill_tokens"] = n_pre
    figures["prefill_tokens_per_s"] = round(n_pre / statistics.median(prefill_once() for _ in range(3)), 1)
    before, rounds = compile_count(), {}
    for b in batches:  # the same shapes again: nothing may compile; decode timed a second time
        ids = [f"again{b}-{i}" for i in range(b)]
        for i in ids:
            eng.add(i, prompt(CONTEXT), greedy, decode_budget, ())
        prefill_all(ids)
        eng.step()
        rounds[str(b)] = [figures["decode_ms"][str(b)], _median_ms(eng.step, args.repeats)]
        for i in ids:
            eng.release(i, cache=False)
    figures["compiles_after_warmup"] = compile_count() - before
    figures["decode_ms_rounds"] = rounds  # [first, last]: a burst of load on the machine hits one
    figures["decode_ms"] = {b: min(r) for b, r in rounds.items()}
    d1, e64 = figures["decode_ms"].get("1"), figures["extend_ms"].get("64")
    if d1 and e64:
        figures["extend64_over_decode1"] = round(e64 / d1, 2)
    figures["collectives"] = {what: {"shape": list(shape), **_collectives(eng, shape)}
                              for what, shape in collective_shapes.items()}
    eng.check_integrity()
    after = roofline.machine_limits()
    limits = {k: max(before_limits[k], after[k]) for k in after}
    figures["machine"] = {**limits, "before": before_limits, "after": after}
    figures["roofline"] = roofline.roofline(figures, cfg, 2 if args.dtype == "bfloat16" else 4, limits, CONTEXT)
    write_figures(figures, args.json)
    print(roofline.table(figures["roofline"]))
    return 0


def _collectives(eng, shape) -> dict:
    """The collectives of the compiled step of `shape` (held already: nothing compiles)."""
    from pddjax.engines import hlo_collectives, precompile, step

    batch, sampling = precompile.dummy_batch(shape)
    compiled = step.build_step(eng.weights, eng.cfg, batch, eng.pool, sampling, max_q_len=shape[3],
                               impl=eng.config.attention, layout=eng.layout)
    counts = hlo_collectives.count(compiled.as_text())
    return {kind: n for kind, n in counts.items() if n["static"]}


SCHEMA_PROPERTIES = 20  # the "schema of 20 properties"


def _schema(tag: str) -> dict:
    kinds = ("string", "integer", "boolean")
    props = {f"{tag}_{i}": {"type": kinds[i % 3]} for i in range(SCHEMA_PROPERTIES)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _constrained(figures, eng, grammar, batches, prompt, prefill_all, budget: int, repeats: int) -> None:
    """The grammar's cost: a fresh 20-property schema's compile (ms), and each batch's decode step
    with every row under that schema (its rows cannot close before 20 fields), measured between
    two plain ones of the same batch (`constrained_over_plain`: against their mean)."""
    from pddjax.grammar.spec import GrammarSpec
    from pddjax.model.sampling_params import SamplingParams

    t0 = time.perf_counter()
    spec = GrammarSpec.json_schema(_schema(f"f{int(t0 * 1e6) % 10**6}"))  # a name never compiled before
    grammar.compile(spec)
    figures["grammar_compile_ms"] = round(1e3 * (time.perf_counter() - t0), 2)
    figures["constrained_decode_ms"], figures["plain_decode_ms"], figures["constrained_over_plain"] = {}, {}, {}

    def decode_ms(b: int, params, tag: str) -> float:
        ids = [f"{tag}{b}-{i}" for i in range(b)]
        for i in ids:
            eng.add(i, prompt(CONTEXT), params, budget, ())
        prefill_all(ids)
        eng.step()
        ms = _median_ms(eng.step, repeats)
        for i in ids:
            if i in eng.seqs:
                eng.release(i, cache=False)
        return ms

    for b in batches:  # plain, constrained, plain: side by side, the ratio against the plain pair's mean
        plain = [decode_ms(b, SamplingParams(), "p")]
        figures["constrained_decode_ms"][str(b)] = ms = decode_ms(b, SamplingParams(grammar=spec), "g")
        plain.append(decode_ms(b, SamplingParams(), "q"))
        figures["plain_decode_ms"][str(b)] = round(statistics.mean(plain), 2)
        figures["constrained_over_plain"][str(b)] = round(ms / statistics.mean(plain), 3)
