"""How an engine step on one core slows a step on another: the host model's `cross_slowdown`.

    python -m tools.hostlab.crosscore --json FILE [--model smollm2-135m] [--repeats 7]

`bench serve` pins P alone on core 0 and RLD + MD on core 1, so processor sharing
(`pddjax/sim/host.py`, `contention.py`) never couples them. They still share the memory system: a
SmolLM2-135M float32 step streams its 540 MB of weights and the KV it gathers, so a decode
step (memory-bound) runs slower while the other core streams weights too. Measured here as
`slow[x|y]` = the time of step class x pinned to core B while another process runs class y
back to back pinned to core A, over x alone just before (so slow drifts of other load hit
both). Classes (`pddjax.sim.host.step_class`): "decode" (one or two one-token rows; timed: 1 row at ~2K
tokens), "decode4" (three or more; timed: 4 rows at ~2K: four times the KV gathered), "small"
(a chunk of at most 64 tokens; timed: 32 after 1K cached), "large" (more; timed: 256 after 768
cached). The host model applies slow[x|y] to a core set's steps of class x while
another core set runs a step of class y (the largest when several). Needs a quiet machine
with at least two cores; jax is imported only inside the functions.
"""

from __future__ import annotations

import os
import statistics
import time

from tools.hostlab.contention import looping_child, median_s

SHAPES = {"decode": (1, 1, 128, 1), "decode4": (4, 4, 128, 1), "small": (32, 1, 64, 32),
          "large": (256, 1, 64, 256)}  # step_table keys of the timed steps
def _decode_step(model, seed: int, rows: int = 1, ctx: int = 1984):
    """step() -> seconds of a decode step of `rows` one-token rows at ~ctx tokens each (page
    table 128 wide), for ever: every 40 steps the rows are released into the prefix cache and
    added again, so they restart at ctx (short steps, not timed) instead of growing out of
    their bucket."""
    import numpy as np

    from pddjax.engines.paged_engine import EngineConfig, PagedEngine
    from pddjax.model.sampling_params import SamplingParams

    g = SamplingParams()
    rng = np.random.default_rng(seed)
    prompts = {f"d{i}": rng.integers(3, model.config.vocab_size, ctx).tolist() for i in range(rows)}
    eng = PagedEngine(model.config, model.weights, model.fingerprint,
                      EngineConfig(dtype="float32", page_size=16, num_pages=8 + rows * (ctx + 64) // 16 * 2,
                                   attention="xla", max_step_tokens=256, max_rows=16, prefix_cache=True))
    state = {"n": 40}

    def step() -> float:
        if state["n"] >= 40:
            for name, prompt in prompts.items():
                if name in eng.seqs:
                    eng.release(name, cache=True)
                eng.add(name, prompt, g, 64, ())
            while any(not eng.seqs[n].generated for n in prompts):
                eng.step()  # the prompts (first time) or their uncached tails
            state["n"] = 0
        state["n"] += 1
        t0 = time.perf_counter()
        eng.step()
        return time.perf_counter() - t0
    return step


def _timed_step(model, cls: str, seed: int):
    """step() -> seconds of one step of the class, repeatable without end."""
    from tools.hostlab import step_table

    if cls in ("decode", "decode4"):
        step = _decode_step(model, seed, rows=SHAPES[cls][1])
    else:
        step = step_table._engine_step(model, step_table.rows_for(SHAPES[cls]), seed)
    step()  # compile
    return step


def _loop(model_name: str, cls: str, core: int, ready, stop) -> None:
    """Child process pinned to `core`: run the class's step back to back until told to stop."""
    from tools.hostlab.calibrate import _model

    os.sched_setaffinity(0, {core})
    step = _timed_step(_model(model_name), cls, seed=7)
    ready.set()
    while not stop.is_set():
        step()


def measure(model_name: str = "smollm2-135m", repeats: int = 7, cores: float = 2.0, pairs=None) -> dict:
    """{"cross_slowdown": {"x|y": slow}, "alone_ms": {x: ms}} for the pairs (default: all), timed
    on the second core of this process's affinity while the child loops on the first (`cores`:
    the shared CLI's host size, unused)."""
    from tools.hostlab.calibrate import _model

    saved = os.sched_getaffinity(0)
    if len(saved) < 2:
        raise RuntimeError("crosscore needs at least two cores")
    loop_core, timed_core = sorted(saved)[:2]
    os.sched_setaffinity(0, {timed_core})
    try:
        model = _model(model_name)
        steps = {c: _timed_step(model, c, seed=0) for c in SHAPES}
        pairs = pairs or [(x, y) for y in SHAPES for x in SHAPES]
        slow, alone = {}, {c: [] for c in SHAPES}
        for y in dict.fromkeys(y for _, y in pairs):
            xs = [x for x, yy in pairs if yy == y]
            base = {x: median_s(steps[x], repeats) for x in xs}  # alone, just before
            with looping_child(_loop, (model_name, y, loop_core), "crosscore"):
                for x in xs:
                    slow[f"{x}|{y}"] = round(median_s(steps[x], repeats) / base[x], 3)
                    alone[x].append(base[x])
                    print(f"{x} while {y} runs on the other core: x{slow[f'{x}|{y}']}", flush=True)
    finally:
        os.sched_setaffinity(0, saved)
    return {"cross_slowdown": slow,
            "alone_ms": {k: round(1e3 * statistics.median(v), 2) for k, v in alone.items() if v}}


def main(argv=None) -> int:
    from tools.hostlab.calibrate import run_cli

    return run_cli("python -m tools.hostlab.crosscore", __doc__, measure, 7, argv,
                   json_help="write the result here (merge cross_slowdown into a calibration JSON to use it)")


if __name__ == "__main__":
    raise SystemExit(main())
