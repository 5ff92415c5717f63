"""Measure the engine step of every shape a benchmark trace uses: the simulator's step table.

    python -m tools.hostlab.step_table --measured BENCH.json --trace TRACE.jsonl \
        --engine-profile engine.json [--calibration IN.json] --json OUT.json [--repeats 5]

XLA runs a step over the whole padded block of its bucketed shape (T tokens, B rows,
page-table width, longest row Q: `pddjax/sim/engine_steps.py`), so the step's time is a
function of that key. This script simulates the trace in every mode the benchmark ran (with
the formula), collects the keys the engines use (~20-40), builds for each a concrete engine
state with exactly that shape (`rows_for`, `_engine_step`) and times its step (median of
`repeats`, after a compile). OUT is the calibration IN (or the defaults) plus `step_table`:
[[T, B, width, Q, ms], ...]; pass it as `--calibration` to `python -m tools.hostlab.validate`.
Needs a quiet machine; jax is imported inside `measure`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from tools.hostlab import calibrate


def rows_for(key: tuple[int, int, int, int], page_size: int = 16) -> list[tuple[int, int]]:
    """(KV length after the step, pending tokens) per row of a step of bucketed shape `key`:
    row 0 has Q tokens, the other B - 1 rows bring the total into (T/2, T]."""
    T, B, width, Q = key
    if Q > T or B > T or min(key) < 1:
        raise ValueError(f"no step has shape {key}")
    end = width * page_size  # the longest row's KV ends in the table's last page
    rows = [(end, Q)]
    left = max(B - 1, min(T, Q * B) - Q)
    for i in range(B - 1):
        n = max(1, min(Q, left - (B - 2 - i)))  # at least 1 for each row still to come
        rows.append((end, n))
        left -= n
    return rows


def _engine_step(model, rows: list[tuple[int, int]], seed: int, num_pages: int | None = None):
    """An engine whose next step has `rows`; returns step() -> seconds. A one-token row is
    a decoding sequence (prefilled, then fed its sampled token each step), KV 48-64 slots
    short of the table's end (it stays in the bucket across the timed steps); a longer row
    is a prompt whose cached prefix (whole pages, warmed first) leaves exactly n tokens."""
    import numpy as np

    from pddjax.engines.paged_engine import EngineConfig, PagedEngine
    from pddjax.model.sampling_params import SamplingParams

    mcfg, g = model.config, SamplingParams()
    rng = np.random.default_rng(seed)
    pages = 8 + sum(-(-(end + 2) // 16) + 1 for end, _ in rows)
    pages = max(pages, num_pages or 0)  # the serving pool's size, if given
    eng = PagedEngine(mcfg, model.weights, model.fingerprint,
                      EngineConfig(dtype="float32", page_size=16, num_pages=pages, attention="xla",
                                   max_step_tokens=256, max_rows=16, prefix_cache=True))
    chunks = []
    for i, (end, n) in enumerate(rows):
        if n == 1:
            eng.add(f"d{i}", rng.integers(3, mcfg.vocab_size, max(1, end - 64)).tolist(), g, 64, ())
            continue
        c = (end - n) // 16 * 16
        prompt = rng.integers(3, mcfg.vocab_size, c + n).tolist()
        chunks.append((f"s{i}", prompt, n))
        if c:
            eng.add(f"w{i}", prompt[:c] + [5], g, 1, (), hold_on_finish=True)  # caches c tokens
    while any(not s.generated for s in eng.seqs.values()):
        eng.step()
    for name in [k for k in eng.seqs if k.startswith("w")]:
        eng.release(name, cache=True)

    def step():
        for name, prompt, _ in chunks:
            eng.add(name, prompt, g, 1, (), hold_on_finish=True)
        got = sorted(s.num_pending for s in eng.seqs.values())
        if got != sorted(n for _, n in rows):
            raise RuntimeError(f"step table: rows pending {got}, wanted {sorted(n for _, n in rows)}")
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        for name, _, _ in chunks:
            eng.release(name, cache=False)
        return dt
    return step


def measure(keys, model_name: str = "smollm2-135m", repeats: int = 5, stop=None) -> list[list]:
    """[[T, B, width, Q, ms], ...] for the given shape keys: one engine at a time (a pool of
    16 rows at 1K tokens is ~0.8 GB of float32 KV), compiled, then the median of `repeats`;
    stops early (the shapes measured so far) when `stop()` turns true."""
    model = calibrate._model(model_name)
    out = []
    for i, key in enumerate(keys):
        if stop is not None and stop():
            print(f"stopped after {len(out)} of {len(keys)} shapes", flush=True)
            break
        step = _engine_step(model, rows_for(key), seed=i)
        step()  # compile
        out.append([*key, round(1e3 * statistics.median(step() for _ in range(repeats)), 2)])
        print(out[-1], flush=True)
    return out


def first_use(keys, model_name: str = "smollm2-135m", repeats: int = 3) -> float:
    """Median extra ms of a shape's first step in a fresh engine over its later steps: the
    engine lowers the shape and loads its executable from the persistent compilation cache
    (run after the shapes were compiled once on this host, e.g. by a step table run, so
    that this times a load, not a compile)."""
    model = calibrate._model(model_name)
    extra = []
    for i, key in enumerate(keys):
        step = _engine_step(model, rows_for(key), seed=i)
        first = step()
        extra.append(first - statistics.median(step() for _ in range(repeats)))
        print(f"{list(key)} first use +{1e3 * extra[-1]:.0f} ms", flush=True)
    return round(1e3 * max(0.0, statistics.median(extra)), 1)


def trace_keys(measured_path: str, trace_path: str | None, engine_json: dict, cal: dict) -> list:
    """The step shapes the simulated benchmark uses, in every mode it ran."""
    from tools.hostlab import validate

    meas = validate.load_measured(measured_path)
    trace = validate.trace_of(meas, trace_path)
    wan = validate.wan_of(meas)
    if wan is None:
        raise ValueError(f"{measured_path} records no emulated WAN")
    host = calibrate.host_config(cal, cpus=validate.cpus_of(meas))
    pred = validate.predict(calibrate.profile(engine_json, cal), wan, host, trace,
                            modes=validate.measured_modes(meas))
    return sorted({tuple(k) for m in pred["modes"].values() for k in m["step_shapes"]})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.hostlab.step_table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measured", required=True)
    ap.add_argument("--trace")
    ap.add_argument("--engine-profile", required=True)
    ap.add_argument("--calibration")
    ap.add_argument("--json", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reuse", metavar="FILE", help="a step table JSON whose shapes are kept, not measured again")
    ap.add_argument("--stop-if-exists", metavar="FILE", help="stop early once FILE exists (the machine got busy)")
    ap.add_argument("--first-use", type=int, metavar="N", default=0,
                    help="also time the first use of N of the shapes in a fresh engine (first_use_ms; "
                         "run after their executables are in the persistent cache)")
    args = ap.parse_args(argv)
    cal = calibrate.load(args.calibration) if args.calibration else dict(calibrate.DEFAULT)
    with open(args.engine_profile, encoding="utf-8") as f:
        engine_json = json.load(f)
    keys = trace_keys(args.measured, args.trace, engine_json, cal)
    kept = calibrate.load(args.reuse).get("step_table", []) if args.reuse else []
    known = {tuple(row[:4]) for row in kept}
    todo = [k for k in keys if k not in known]
    print(f"{len(keys)} step shapes, {len(keys) - len(todo)} of them reused", flush=True)
    stop = (lambda: os.path.exists(args.stop_if_exists)) if args.stop_if_exists else None
    out = {**cal, "step_table": sorted(kept + measure(todo, args.model, args.repeats, stop))}
    if args.first_use:
        decode = [k for k in keys if k[3] == 1]
        chunks = [k for k in keys if k[3] > 1 and k[0] <= 128]  # a 256-token chunk's warm-up already runs its shape
        picks = (decode[: args.first_use // 2] + chunks)[: args.first_use]
        out["first_use_ms"] = first_use(picks, args.model)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["step_table"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
