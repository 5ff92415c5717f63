"""Host calibration for `python -m tools.hostlab.validate`: what `bench engine` does not measure.

    python -m tools.hostlab.calibrate --json FILE [--model smollm2-135m] [--repeats 3]

Measures on this machine, with the paged engine and the real KV wire code:
- `attention_ns_per_pair`, `gather_ns_per_slot`, `gather_far_ns_per_slot`: how a step's time
  grows with context (`pddjax/sim/engine_steps.py`): a 256-token prefill chunk at context 0 and 768,
  decode steps of 1, 4 and 8 rows at ~130 and ~1,000 tokens (`_fit_context`), the steps
  of all setups timed in turn so that load from other processes hits them alike;
- `step_cores`, `decode_cores`: the cores a prefill chunk and a decode step keep busy alone,
  as their speedup from one core to all (timed pinned to one core and unpinned, in turn; a
  proxy: `python -m tools.hostlab.contention` measures them as the host model uses them);
- a check, not a fit (`check_ms`): a two-row step (216 + 40 tokens after 768 / 896 cached)
  against the formula's prediction from the other setups;
- `export_us_per_token` (P: gather the KV out of the pool), `serialize_us_per_token` (cut it
  into KVChunks + protobuf), `import_us_per_token` (parse, check, write into a pool), per
  token of SmolLM2-135M float32 KV, from 1,024-token runs.
`request_overhead_ms` (the router's own work per request) and `rpc_ms` (one loopback gRPC
round trip, besides waiting for the engine thread) are not measured here (defaults below).
It imports jax (and the KV wire code) only inside `measure`. `DEFAULT` holds the
figures measured on the 2-core development VM (tools/hostlab/README.md, "Validation").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pddjax.sim.config import HostConfig
from pddjax.sim.measured import MeasuredInstance

DEFAULT = {  # measured on the 2-core development VM, 2026-11-30 03:11 (tools/hostlab/README.md)
    "cores": 2.0,
    "step_cores": 2.0,  # not measured cleanly yet (see tools/hostlab/README.md)
    "decode_cores": 2.0,
    "attention_ns_per_pair": 1564.8,
    "gather_ns_per_slot": 5489.7,
    "gather_far_ns_per_slot": 8673.0,
    "export_us_per_token": 13.75,
    "serialize_us_per_token": 36.5,
    "import_us_per_token": 48.8,
    "request_overhead_ms": 5.0,
    "rpc_ms": 3.0,
    "unshaped_mbps": 400.0,
    "background_cores": 0.0,
}
KEYS = tuple(DEFAULT)


def load(path: str) -> dict:
    """A calibration JSON (missing keys from DEFAULT); ValueError with a sentence if unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read calibration {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} is not a JSON object")  # noqa: TRY004  (a user error: one sentence)
    out = dict(DEFAULT)
    for k in KEYS:
        if k in obj:
            if not isinstance(obj[k], (int, float)) or obj[k] < 0:
                raise ValueError(f"calibration {k!r} must be a number >= 0")
            out[k] = float(obj[k])
    if "step_table" in obj:  # measured step shapes (step_table.py); checked by MeasuredInstance
        out["step_table"] = obj["step_table"]
    if "first_use_ms" in obj:  # step_table.py --first-use
        if not isinstance(obj["first_use_ms"], (int, float)) or obj["first_use_ms"] < 0:
            raise ValueError("calibration 'first_use_ms' must be a number >= 0")
        out["first_use_ms"] = float(obj["first_use_ms"])
    if "cross_slowdown" in obj:  # crosscore.py: {"x|y": slowdown}
        cross = obj["cross_slowdown"]
        if not isinstance(cross, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in cross.values()):
            raise ValueError("calibration 'cross_slowdown' must map 'x|y' to positive numbers")
        out["cross_slowdown"] = {str(k): float(v) for k, v in cross.items()}
    if min(out["cores"], out["step_cores"], out["decode_cores"]) <= 0:
        raise ValueError("calibration cores, step_cores and decode_cores must be positive")
    return out


def profile(engine_json: dict, cal: dict) -> MeasuredInstance:
    """The engine profile with the calibration's context terms (unless the profile has its own)."""
    obj = {"kv_bytes_per_token": 46_080.0, **engine_json}  # `bench engine` profiles of SmolLM2-135M f32
    for k in ("attention_ns_per_pair", "gather_ns_per_slot", "gather_far_ns_per_slot"):
        obj.setdefault(k, cal[k])
    if cal.get("step_table"):
        obj["step_table"] = cal["step_table"]
    obj.setdefault("first_use_ms", cal.get("first_use_ms", 0.0))
    return MeasuredInstance.from_json(obj)


def host_config(cal: dict, **engine) -> HostConfig:
    """The benchmark's host (`engine`: HostConfig overrides such as kv_pages)."""
    return HostConfig(cores=cal["cores"], background_cores=cal["background_cores"],
                      step_cores=min(cal["step_cores"], cal["cores"]),
                      decode_cores=min(cal["decode_cores"], cal["cores"]),
                      request_overhead_s=cal["request_overhead_ms"] / 1e3, rpc_s=cal["rpc_ms"] / 1e3,
                      export_s_per_token=cal["export_us_per_token"] / 1e6,
                      serialize_s_per_token=cal["serialize_us_per_token"] / 1e6,
                      import_s_per_token=cal["import_us_per_token"] / 1e6,
                      unshaped_gbps=cal["unshaped_mbps"] / 1e3,
                      cross_slowdown=tuple(sorted(cal.get("cross_slowdown", {}).items())), **engine)


# ---- measuring (jax from here on) ---------------------------------------------------------
# Step setups: (name, rows, context): "chunk" = one 256-token prefill chunk after `context`
# cached tokens; "decode" = `rows` one-token rows at ~`context` tokens (they stay in one
# page-table bucket for the steps timed).
SETUPS = [("chunk", 1, 0), ("chunk", 1, 768), ("mixed", 2, 768), ("decode", 1, 128), ("decode", 1, 980),
          ("decode", 4, 128), ("decode", 4, 980), ("decode", 8, 128), ("decode", 8, 980)]


def _model(model_name: str):
    from pddjax.model.jax_setup import configure

    configure()
    from pddjax.model.registry import load_model

    return load_model(model_name)


def _setup(model, kind: str, rows: int, ctx: int, seed: int):
    """An engine whose next step is the setup's step; returns step() -> seconds."""
    import numpy as np

    from pddjax.engines.paged_engine import EngineConfig, PagedEngine
    from pddjax.model.sampling_params import SamplingParams

    mcfg, g = model.config, SamplingParams()
    rng = np.random.default_rng(seed)
    pages = 8 + rows * (-(-(ctx + 320) // 16)) * (2 if kind == "chunk" else 1) + (200 if kind == "mixed" else 0)
    eng = PagedEngine(mcfg, model.weights, model.fingerprint,
                      EngineConfig(dtype="float32", page_size=16, num_pages=pages, attention="xla",
                                   max_step_tokens=256, max_rows=16, prefix_cache=kind in ("chunk", "mixed")))
    if kind in ("chunk", "mixed"):
        # chunk: one row of 256 after ctx cached tokens; mixed: that row cut to 216 plus a
        # 40-token row after ctx + 128 cached tokens (B = 2: the padded attention doubles)
        rows_ = [(ctx, 256)] if kind == "chunk" else [(ctx, 216), (ctx + 128, 40)]
        prompts = [rng.integers(3, mcfg.vocab_size, c + n).tolist() for c, n in rows_]
        for i, (c, _) in enumerate(rows_):
            if c:
                eng.add(f"warm{i}", prompts[i][:c] + [5], g, 1, (), hold_on_finish=True)  # caches c tokens
                while not eng.seqs[f"warm{i}"].generated:
                    eng.step()
                eng.release(f"warm{i}", cache=True)

        def step():
            for i, pr in enumerate(prompts):
                eng.add(f"c{i}", pr, g, 1, (), hold_on_finish=True)
            pending = [eng.seqs[f"c{i}"].num_pending for i in range(len(prompts))]
            if pending != [n for _, n in rows_]:  # the step must be the shape named, or the fit is wrong
                raise RuntimeError(f"calibration setup {kind} ctx {ctx}: rows pending {pending}, "
                                   f"wanted {[n for _, n in rows_]}")
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            for i in range(len(prompts)):
                eng.release(f"c{i}", cache=False)
            return dt
    else:
        names = [f"d{i}" for i in range(rows)]
        for n in names:
            eng.add(n, rng.integers(3, mcfg.vocab_size, ctx).tolist(), g, 300, ())
        while any(not eng.seqs[n].generated for n in names):
            eng.step()

        def step():
            t0 = time.perf_counter()
            eng.step()
            return time.perf_counter() - t0
    step()  # compile this shape
    return step


def _interleaved(steps: dict, repeats: int) -> dict:
    """Median seconds per setup, the setups' steps taken in turn (so load drifts hit all alike)."""
    times: dict = {k: [] for k in steps}
    for _ in range(repeats):
        for k, fn in steps.items():
            times[k].append(fn())
    return {k: statistics.median(v) for k, v in times.items()}


def _name(kind: str, rows: int, ctx: int) -> str:
    return {"chunk": f"chunk256_ctx{ctx}", "mixed": f"mixed2x_ctx{ctx}"}.get(kind, f"decode_b{rows}_ctx{ctx}")


def _fit_context(t: dict, knee: int = 1024) -> tuple[float, float, float]:
    """(a, g, g_far) in seconds from the step-time differences (engine_steps.kv_slots):
    a 256-token chunk and a 1-row decode step both gather 256 -> 1,024 slots (below the
    knee), so their difference separates a from g; 4 and 8 rows gather 1,024 / 2,048 ->
    4,096 / 8,192 slots (beyond it) and give g_far (least squares of the two)."""
    from pddjax.sim.engine_steps import kv_slots

    lo, hi = kv_slots(129, 16), kv_slots(981 + 40, 16)  # 256, 1024 (the chunk: 256 -> 1,024 too)
    dc = hi - lo
    dp = t["chunk256_ctx768"] - t["chunk256_ctx0"]  # = a * 256 * dc + g * dc
    d1 = t["decode_b1_ctx980"] - t["decode_b1_ctx128"]  # = a * dc + g * dc
    a = max(0.0, (dp - d1) / (255 * dc))
    g = max(0.0, d1 / dc - a)
    num = den = 0.0
    for b in (4, 8):  # d_b = b a dc + g (near part) + g_far (far part)
        x0, x1 = b * lo, b * hi
        near = min(x1, knee) - min(x0, knee)
        far = max(x1 - knee, 0) - max(x0 - knee, 0)
        y = t[f"decode_b{b}_ctx980"] - t[f"decode_b{b}_ctx128"] - b * a * dc - g * near
        num, den = num + far * y, den + far * far
    return a, g, max(0.0, num / den)


def _cores(steps: dict, repeats: int, cores: float) -> dict:
    """Speedup of each step from one core to all of them: the cores it keeps busy alone (its
    share under processor sharing). Timed pinned to one core and to all, in turn, so that
    load from other processes hits both alike."""
    import os

    def pin(cpus) -> None:  # every thread of this process (XLA's workers are threads of their own)
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:
                pass

    every = os.sched_getaffinity(0)
    one = {min(every)}
    t1: dict = {k: [] for k in steps}
    tn: dict = {k: [] for k in steps}
    try:
        for _ in range(repeats):
            for k, fn in steps.items():
                pin(one)
                t1[k].append(fn())
                pin(every)
                tn[k].append(fn())
    finally:
        pin(every)
    return {k: min(max(statistics.median(t1[k]) / statistics.median(tn[k]), 1.0), cores) for k in steps}


def _wire(n: int = 1024, repeats: int = 3) -> dict:
    """Microseconds per token: export from a pool, chunk + serialize, parse + import."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pddjax.kv.canonical import export_run, import_run
    from pddjax.kv.pool import KVPool
    from serving.kvwire import Assembler, Chunker
    from serving.pb import cluster_pb2

    pool = KVPool.zeros(30, 3, 1024, 16, 64, jnp.float32)  # SmolLM2-135M's layout
    pages = list(range(1, n // 16 + 2))
    res = []
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        run = export_run(pool, pages, 0, n, "fp")
        t1 = time.perf_counter()
        msgs = [c.SerializeToString() for c in Chunker("r", 0, n, 2 << 20).feed(run, [5])]
        t2 = time.perf_counter()
        asm, runs = Assembler("fp"), []
        for m in msgs:
            r = asm.feed(cluster_pb2.KVChunk.FromString(m))
            if r is not None:
                runs.append(r)
        for r in runs:
            pool = import_run(pool, r, pages, "fp")
        jax.block_until_ready(pool.k)
        t3 = time.perf_counter()
        if rep:
            res.append([t1 - t0, t2 - t1, t3 - t2])
    med = np.median(np.array(res), axis=0) * 1e6 / n  # [3]
    return {"export_us_per_token": float(med[0]), "serialize_us_per_token": float(med[1]),
            "import_us_per_token": float(med[2])}


def measure(model_name: str = "smollm2-135m", repeats: int = 8, cores: float = 2.0) -> dict:
    model = _model(model_name)
    steps = {_name(*st): _setup(model, *st, seed=i) for i, st in enumerate(SETUPS)}
    t = _interleaved(steps, repeats)
    a, g, g_far = _fit_context(t)
    u = _cores({k: steps[k] for k in ("chunk256_ctx768", "decode_b4_ctx980")}, max(3, repeats // 2), cores)
    u_p, u_d = u["chunk256_ctx768"], u["decode_b4_ctx980"]
    out = dict(DEFAULT)
    out.update({"cores": cores, "attention_ns_per_pair": round(a * 1e9, 1), "gather_ns_per_slot": round(g * 1e9, 1),
                "gather_far_ns_per_slot": round(g_far * 1e9, 1), "step_cores": round(u_p, 2),
                "decode_cores": round(u_d, 2)})
    out.update({k: round(v, 2) for k, v in _wire().items()})
    out["steps_ms"] = {k: round(1e3 * v, 2) for k, v in t.items()}
    # a check, not a fit: the two-row step as engine_steps predicts it from the rest
    from pddjax.sim.engine_steps import StepModel

    base = {"decode_ms": {"1": 1e3 * t["decode_b1_ctx128"]}, "extend_ms": {"1": 1e3 * t["decode_b1_ctx128"]},
            "prefill_tokens_per_s": 512 / 1.0, "context": 128}
    m = StepModel(profile(base, out))
    lin = t["chunk256_ctx768"] - m.step_s(chunks=[(256, 1024)]) + m.lin(256)  # this host's lin(256)
    pred = lin + m.step_s(chunks=[(216, 984), (40, 936)]) - m.lin(256)
    out["check_ms"] = {"mixed2x_ctx768": {"measured": round(1e3 * t["mixed2x_ctx768"], 1),
                                          "model": round(1e3 * pred, 1)}}
    return out


def run_cli(prog: str, doc: str, measure_fn, repeats: int, argv=None, json_help: str | None = None) -> int:
    """The shared CLI of the measuring tools: --json, --model, --repeats, --cores -> measure_fn's
    dict, written to --json and printed."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help=json_help)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--cores", type=float, default=2.0, help="cores of this host")
    args = ap.parse_args(argv)
    out = measure_fn(args.model, args.repeats, args.cores)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


def main(argv=None) -> int:
    return run_cli("python -m tools.hostlab.calibrate", __doc__, measure, 8, argv)


if __name__ == "__main__":
    raise SystemExit(main())
