"""`pddjax bench speculative`: prompt-lookup speculation on and off, side by side, per workload.

One paged engine with `[engine] speculative = "ngram"`; the "off" runs are the same requests
with `SamplingParams(speculative=False)` (the per-request opt-out), so both columns run the same
compiled shapes on the same engine in the same minute. Per workload (serving/bench/speculative/
workloads.py) and stream count (1: the 4 requests one after another; 4: all at once), each mode
prefills untimed, then its decode is timed to the last token:

  decode tok/s per stream = decode tokens / decode seconds / streams   (the user's rate)
  speedup    = on / off over the cell's rounds (the same tokens: outputs are compared, `exact`)
  acceptance = drafts accepted / drafts verified (speculation on)
  exact      = both modes gave the same tokens; where a greedy stream did not, `diverged_at` and
               `mismatch_margins` (the dense reference's top-1 minus top-2 logit there: a verify
               step sums in another order than a plain one, so a float near-tie can flip)

Every decode member up to the longest request's page-table width is built first (how many rows a
step has depends on the drafts the timed cost rule keeps), and a first round of every cell runs
unmeasured (it compiles what else the measured rounds will use), so `compiles_measured` must
read 0. Each cell then runs `--rounds` rounds of both modes, their order alternating within the
cell (off on, on off: the machine's drift over a cell weighs on both modes alike) and across
cells; the figures are sums over the rounds, with each round's own speedup beside them. The
engine steps run in this process: a cell measures the engine, not a stack (`bench serve` does
that).
"""

from __future__ import annotations

import dataclasses
import time

from pddjax.errors import UserError
from pddjax.report import write_figures
from serving.bench.load.figures import exact_label, explain_mismatches
from serving.bench.speculative.workloads import STREAMS, build

WORKLOADS = ("copy", "agentic", "nomatch")


def register(bsub) -> None:
    p = bsub.add_parser("speculative", help="prompt-lookup speculation on vs off per workload (engine level)")
    p.add_argument("--model", default="smollm2-135m", help="a model with a tokenizer: smollm2-135m | PATH")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--streams", default=f"1,{STREAMS}", help=f"comma list of stream counts (1..{STREAMS})")
    p.add_argument("--max-tokens", type=int, default=160, help="output tokens per request at most")
    p.add_argument("--spec-max-tokens", type=int, default=4, help="drafted tokens per row per step at most")
    p.add_argument("--rounds", type=int, default=2,
                   help="measured rounds of both modes per cell, their order alternating (2: off on, on off)")
    p.add_argument("--json", help="write the figures to this file")
    p.set_defaults(func=run)


def _decode(eng, reqs, on: bool, tag: str) -> dict:
    """Run `reqs` at once on `eng`: prefill untimed, then every step to the end, timed."""
    ids = [f"{tag}-{i}" for i in range(len(reqs))]
    for i, r in zip(ids, reqs):
        eng.add(i, r.prompt, dataclasses.replace(r.params, speculative=on), r.max_tokens, r.stop_ids,
                hold_on_finish=True)
    seqs = [eng.seqs[i] for i in ids]
    while any(not s.generated for s in seqs):
        eng.step()
    before = sum(len(s.generated) for s in seqs)
    drafted, accepted, steps = eng.spec_drafted, eng.spec_accepted, eng.num_steps
    t0 = time.perf_counter()
    while eng.has_work():
        eng.step()
    seconds = time.perf_counter() - t0
    out = {"outputs": [list(s.generated) for s in seqs], "seconds": seconds,
           "tokens": sum(len(s.generated) for s in seqs) - before, "steps": eng.num_steps - steps,
           "drafted": eng.spec_drafted - drafted, "accepted": eng.spec_accepted - accepted}
    for i in ids:
        eng.release(i, cache=False)
    return out


def _mode(eng, reqs, streams: int, on: bool, tag: str) -> dict:
    """`reqs` at `streams` at a time -> the summed decode figures of the mode."""
    parts = [_decode(eng, reqs[i:i + streams], on, f"{tag}-{i}") for i in range(0, len(reqs), streams)]
    total = {k: sum(p[k] for p in parts) for k in ("seconds", "tokens", "steps", "drafted", "accepted")}
    total["outputs"] = [o for p in parts for o in p["outputs"]]
    return total


def _cell(eng, reqs, streams: int, flip: bool, tag: str, rounds: int = 1) -> dict:
    """`rounds` rounds of both modes, their order alternating (off, on / on, off / ...; `flip`
    starts with on), so a machine that speeds up or slows down within the cell weighs on both
    modes alike. Seconds, tokens, steps and drafts are summed over the rounds; `speedups` lists
    each round's own on / off (the spread the cell's `speedup` carries)."""
    keys = ("seconds", "tokens", "steps", "drafted", "accepted")
    total = {on: dict.fromkeys(keys, 0) for on in (False, True)}
    outputs, speedups, every = {}, [], []
    for i in range(rounds):
        order = (True, False) if (i % 2 == 1) != flip else (False, True)
        runs = {on: _mode(eng, reqs, streams, on, f"{tag}-{i}-{'on' if on else 'off'}") for on in order}
        for on, m in runs.items():
            for k in keys:
                total[on][k] += m[k]
            outputs.setdefault(on, m["outputs"])
            every.append(m["outputs"])
        speedups.append(round(_rate(runs[True], streams) / _rate(runs[False], streams), 3)
                        if _rate(runs[False], streams) else None)
    off, on = total[False], total[True]
    return {"off_tok_s_per_stream": round(_rate(off, streams), 2), "on_tok_s_per_stream": round(_rate(on, streams), 2),
            "speedup": round(_rate(on, streams) / _rate(off, streams), 3) if _rate(off, streams) else None,
            "speedups": speedups, "rounds": rounds,
            "acceptance": round(on["accepted"] / on["drafted"], 3) if on["drafted"] else 0.0,
            "drafted": on["drafted"], "accepted": on["accepted"], "decode_tokens": on["tokens"],
            "steps_off": off["steps"], "steps_on": on["steps"],
            "decode_s_off": round(off["seconds"], 3), "decode_s_on": round(on["seconds"], 3),
            "exact": all(o == outputs[False] for o in every),
            "diverged_at": [[i, _first_difference(a, b)] for i, (a, b) in enumerate(zip(outputs[False], outputs[True]))
                            if a != b]}


def _rate(m: dict, streams: int) -> float:
    return m["tokens"] / m["seconds"] / streams if m["seconds"] else 0.0


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(args) -> int:
    from pddjax.model.jax_setup import configure

    configure()
    import jax

    from pddjax.engines.engine_config import EngineConfig
    from pddjax.engines.paged_engine import PagedEngine
    from pddjax.engines.precompile import build_shape
    from pddjax.engines.step import compile_count
    from pddjax.model.gguf_meta import GGUFError
    from pddjax.model.registry import ModelNotFound, load_model

    try:
        names = [w for w in args.workloads.split(",") if w]
        streams = [int(s) for s in args.streams.split(",") if s]
    except ValueError as e:
        raise UserError(f"--streams: {e}") from None
    if bad := [w for w in names if w not in WORKLOADS]:
        raise UserError(f"unknown workload(s) {', '.join(bad)}; expected {', '.join(WORKLOADS)}")
    if not streams or any(not 1 <= s <= STREAMS for s in streams):
        raise UserError(f"--streams must be counts in 1..{STREAMS}, got {args.streams!r}")
    if args.spec_max_tokens < 1 or args.max_tokens < 1 or args.rounds < 1:
        raise UserError("--spec-max-tokens, --max-tokens and --rounds must be at least 1")
    try:
        model = load_model(args.model)
    except (ModelNotFound, GGUFError, ValueError) as e:
        raise UserError(str(e)) from None
    if model.tokenizer is None:
        raise UserError(f"model {args.model!r} has no tokenizer: the workloads are text")
    try:
        workloads = {w: build(w, model, args.max_tokens) for w in names}
    except ValueError as e:
        raise UserError(str(e)) from None
    longest = max(len(r.prompt) + r.max_tokens for reqs in workloads.values() for r in reqs)
    S, rows = 16, STREAMS * (args.spec_max_tokens + 1)
    ecfg = EngineConfig(page_size=S, num_pages=STREAMS * -(-longest // S) + 8, max_step_tokens=512,
                        max_rows=rows, speculative="ngram", spec_max_tokens=args.spec_max_tokens)
    eng = PagedEngine(model.config, model.weights, model.fingerprint, ecfg)
    figures = {"model": model.config.name, "backend": jax.default_backend(), "spec_max_tokens": args.spec_max_tokens,
               "max_tokens": args.max_tokens, "rounds": args.rounds, "workloads": {}}
    widest = min((mp for _, _, mp, _ in eng.stated if mp * S >= longest), default=max(s[2] for s in eng.stated))
    for shape in eng.stated:  # which decode members a step takes depends on the drafts the timed
        if shape[3] == 1 and shape[2] <= widest:  # cost rule keeps, so every one is built first
            build_shape(eng, shape)
    cells = [(w, s) for w in names for s in streams]
    for w, s in cells:  # warm-up: every shape the measured round takes is compiled here
        _cell(eng, workloads[w], s, False, f"warm-{w}-{s}")
    before = compile_count()
    for n, (w, s) in enumerate(cells):
        figures["workloads"].setdefault(w, {})[str(s)] = _cell(eng, workloads[w], s, n % 2 == 1, f"{w}-{s}",
                                                               args.rounds)
    figures["compiles_measured"] = compile_count() - before
    for w, cells_ in figures["workloads"].items():  # greedy streams that differ: at a float near-tie?
        for c in cells_.values():
            if c["diverged_at"] and all(r.params.temperature == 0 for r in workloads[w]):
                explain_mismatches(c, model, [r.prompt for r in workloads[w]])
    figures["exact"] = all(c["exact"] for cells_ in figures["workloads"].values() for c in cells_.values())
    eng.check_integrity()
    write_figures(figures, args.json)
    print(table(figures))
    return 0


def table(figures: dict) -> str:
    lines = ["| workload | streams | off tok/s/stream | on tok/s/stream | speedup | acceptance | exact |",
             "|---|---|---|---|---|---|---|"]  # exact: "False (k at a near-tie)" where k diverged at a tie
    for w, cells in figures["workloads"].items():
        for s, c in cells.items():
            lines.append(f"| {w} | {s} | {c['off_tok_s_per_stream']} | {c['on_tok_s_per_stream']} | "
                         f"{c['speedup']} | {c['acceptance']} | {exact_label(c)} |")
    return "\n".join(lines)
