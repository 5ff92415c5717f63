"""How engine steps of two processes slow each other down: the host model's `step_cores`
and `decode_cores`, measured the way `pddjax/sim/host.py` uses them.

    python -m tools.hostlab.contention --json FILE [--model smollm2-135m] [--repeats 6]

`pddjax/sim/host.py` shares the cores by processor sharing: a job that keeps c cores busy alone, run
while other jobs keep d more busy on a host of C cores, runs min(1, C / (c + d)) as fast.
So a step timed alone and then while another *process* runs the same step in a loop slows
down by s = max(1, 2c / C), i.e. c = C * s / 2 (exact when s > 1; s = 1 says only c <= C/2).
Measured for a 256-token prefill chunk at context 768 (P's steps: `step_cores`) and a 4-row
decode step at ~1,000 tokens (RLD's and MD's: `decode_cores`); the cross pairs (chunk while
decode loops, and the reverse) check the model: both should slow down by (c_p + c_d) / C.
Each "alone" time is taken right before its "with" time, so slow drifts of other load hit
both. Needs a quiet machine (nothing else busy); jax is imported only inside the functions.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import statistics

KINDS = {"chunk": ("chunk", 1, 768), "decode": ("decode", 4, 980)}


def _loop(model_name: str, setup: tuple, ready, stop) -> None:
    """Child process: run the setup's step back to back until told to stop."""
    from tools.hostlab.calibrate import _model, _setup

    step = _setup(_model(model_name), *setup, seed=1)
    ready.set()
    while not stop.is_set():
        step()


def median_s(step, repeats: int) -> float:
    """Median seconds of `repeats` calls of step() -> seconds."""
    return statistics.median(step() for _ in range(repeats))


@contextlib.contextmanager
def looping_child(target, args: tuple, what: str):
    """A spawned process running target(*args, ready, stop) (a step back to back until
    `stop`); the block runs once it has set `ready`, and the child is stopped after it."""
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=target, args=(*args, ready, stop), daemon=True)
    child.start()
    try:
        if not ready.wait(600):
            raise RuntimeError(f"the {what} child did not start within 600 s")
        yield
    finally:
        stop.set()
        child.join(60)
        if child.is_alive():
            child.kill()


def measure(model_name: str = "smollm2-135m", repeats: int = 6, cores: float = 2.0, kinds: dict = KINDS) -> dict:
    """`kinds`: {"chunk": setup, "decode": setup} as calibrate's SETUPS entries."""
    from tools.hostlab.calibrate import _model, _setup

    model = _model(model_name)
    steps = {k: _setup(model, *v, seed=0) for k, v in kinds.items()}
    alone: dict = {k: [] for k in steps}
    slow: dict = {}
    for other, setup in kinds.items():
        base = {k: median_s(fn, repeats) for k, fn in steps.items()}  # alone, just before
        with looping_child(_loop, (model_name, setup), "contention"):
            for k, fn in steps.items():
                slow[f"{k}|{other}"] = round(median_s(fn, repeats) / base[k], 3)
                alone[k].append(base[k])
    c_p = cores * max(1.0, slow["chunk|chunk"]) / 2
    c_d = cores * max(1.0, slow["decode|decode"]) / 2
    return {"cores": cores, "step_cores": round(min(c_p, cores), 2), "decode_cores": round(min(c_d, cores), 2),
            "slowdown": slow, "cross_predicted": round(max(1.0, (c_p + c_d) / cores), 3),
            "alone_ms": {k: round(1e3 * statistics.median(v), 2) for k, v in alone.items()}}


def main(argv=None) -> int:
    from tools.hostlab.calibrate import run_cli

    return run_cli("python -m tools.hostlab.contention", __doc__, measure, 6, argv,
                   json_help="write the result here (merge step_cores / decode_cores into a calibration JSON "
                             "to use them)")


if __name__ == "__main__":
    raise SystemExit(main())
