"""Weights cache: seconds and peak host memory of a save and a restore, the flat layout
(`pddjax/model/checkpoint_cache.py`) against the orbax per-weight layout it replaced (kept here,
for this measurement only), and the floor: `np.fromfile` of the same bytes.

    .venv/bin/python -m tools.weights_cache_bench [--model smollm2-135m] [--repeat 3] [--parallel 3] [--json F]

One scratch cache (deleted after). The model is converted once in this process (GGUF -> float32),
then saved in both layouts (seconds and the host memory a save adds over the weights already
resident). Every restore runs in a fresh process (so its peak is its own), `--repeat` times per
kind, interleaved in a rotating order; then `--parallel` processes of each kind at once, as
`pddjax up` starts its services. The files are in the page cache (a warm start). Peaks are
RssAnon (memwatch.py); "import s" is the child's imports (orbax's included for orbax).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from pddjax import env

KINDS = ("orbax", "flat", "numpy")


def orbax_save(root: str, arrays: dict) -> None:
    """The layout-2 save: one orbax checkpoint per weight under root/tensors/<name>/."""
    import orbax.checkpoint as ocp

    ckpt = ocp.PyTreeCheckpointer()
    for name, arr in arrays.items():
        ckpt.save(os.path.join(root, "tensors", name), {"a": arr})


def orbax_restore(root: str, names: list[str]) -> dict:
    """The layout-2 restore."""
    import numpy as np
    import orbax.checkpoint as ocp

    ckpt = ocp.PyTreeCheckpointer()
    return {name: np.asarray(ckpt.restore(os.path.join(root, "tensors", name))["a"]) for name in names}


def child(kind: str, scratch: str, fingerprint: str) -> dict:
    """One restore of `kind` in this (fresh) process: import and restore seconds, memory."""
    os.environ[env.CACHE_DIR.name] = os.path.join(scratch, "cache")
    t0 = time.perf_counter()
    import numpy as np

    from pddjax.model import checkpoint_cache
    from pddjax.model.memwatch import PeakMemory

    if kind == "orbax":
        import orbax.checkpoint  # noqa: F401  (what a layout-2 start imported)
    import_s = time.perf_counter() - t0
    flat = os.path.join(scratch, "cache", "weights", fingerprint)
    with open(os.path.join(flat, "meta.json")) as f:
        names = sorted(json.load(f)["tensors"])
    t1 = time.perf_counter()
    with PeakMemory() as mem:
        if kind == "orbax":
            d = orbax_restore(os.path.join(scratch, "orbax"), names)
        elif kind == "flat":
            w, _ = checkpoint_cache.restore(fingerprint)
            d = checkpoint_cache.wmod.to_dict(w)
        else:
            d = {n: np.fromfile(os.path.join(flat, "tensors", f"{n}.bin"), np.uint8) for n in names}
    s = mem.summary()
    return {"kind": kind, "import_s": round(import_s, 3), "restore_s": round(time.perf_counter() - t1, 3),
            "mb": round(sum(a.nbytes for a in d.values()) / (1 << 20), 1),
            "anon_added_mb": round(s["anon_peak_mb"] - s["anon_before_mb"], 1), "anon_peak_mb": s["anon_peak_mb"]}


def spawn(kinds: list[str], scratch: str, fingerprint: str) -> tuple[list[dict], float]:
    """Run one child per kind at once; their results and the wall until the last is done."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "tools.weights_cache_bench", "--child", k, "--scratch", scratch,
                               "--fingerprint", fingerprint], stdout=subprocess.PIPE, text=True) for k in kinds]
    out = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a restore failed: {[p.returncode for p in procs]}")
    return out, time.perf_counter() - t0


def timed_save(fn) -> dict:
    from pddjax.model.memwatch import PeakMemory

    t0 = time.perf_counter()
    with PeakMemory() as mem:
        fn()
    s = mem.summary()
    added = s["anon_peak_mb"] - s["anon_before_mb"]
    return {"seconds": round(time.perf_counter() - t0, 2), "anon_added_mb": round(added, 1)}


def du_mb(path: str) -> tuple[float, int]:
    total, files = 0, 0
    for d, _, fs in os.walk(path):
        for f in fs:
            total, files = total + os.path.getsize(os.path.join(d, f)), files + 1
    return round(total / (1 << 20), 1), files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    ap.add_argument("--fingerprint", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.scratch, args.fingerprint)))
        return 0
    scratch = tempfile.mkdtemp(prefix="pddjax-wcache-")
    os.environ[env.CACHE_DIR.name] = os.path.join(scratch, "cache")
    try:
        from pddjax.model import checkpoint_cache
        from pddjax.model import weights as wmod
        from pddjax.model.registry import load_model

        m = load_model(args.model, use_cache=False)
        meta = {"config": m.config.to_json()}
        fig: dict = {"model": args.model, "convert_s": round(m.load_seconds, 2),
                     "weights_mb": m.memory["weights_mb"], "tensors": len(wmod.to_dict(m.weights))}
        fig["save"] = {"orbax": timed_save(lambda: orbax_save(os.path.join(scratch, "orbax"), wmod.to_dict(m.weights))),
                       "flat": timed_save(lambda: checkpoint_cache.save(m.fingerprint, m.weights, meta))}
        checkpoint_cache.check_integrity(m.fingerprint)
        del m.weights
        fig["disk"] = {"orbax": du_mb(os.path.join(scratch, "orbax")), "flat": du_mb(os.path.join(scratch, "cache"))}
        runs = {k: [] for k in KINDS}
        for i in range(args.repeat):
            for k in KINDS[i % 3:] + KINDS[:i % 3]:  # each kind in each place of the order
                runs[k] += spawn([k], scratch, m.fingerprint)[0]
        fig["restore"] = {k: {"restore_s_median": statistics.median(r["restore_s"] for r in v),
                              "import_s_median": statistics.median(r["import_s"] for r in v),
                              "anon_added_mb_max": max(r["anon_added_mb"] for r in v), "runs": v}
                          for k, v in runs.items()}
        fig["parallel"] = {}
        for k in ("orbax", "flat"):
            res, wall = spawn([k] * args.parallel, scratch, m.fingerprint)
            fig["parallel"][k] = {"processes": args.parallel, "wall_s": round(wall, 2),
                                  "restore_s_max": max(r["restore_s"] for r in res)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{fig['model']}: {fig['tensors']} tensors, {fig['weights_mb']} MB; converted from the files in "
          f"{fig['convert_s']} s")
    print(f"{'':8} {'save s':>7} {'save +MB':>9} {'disk MB':>8} {'files':>6} {'restore s':>10} {'import s':>9} "
          f"{'restore +MB':>12} {'x' + str(args.parallel) + ' at once s':>14}")
    for k in KINDS:
        sv, dk, r = fig["save"].get(k, {}), fig["disk"].get(k, ("", "")), fig["restore"][k]
        par = fig["parallel"].get(k, {})
        print(f"{k:8} {sv.get('seconds', ''):>7} {sv.get('anon_added_mb', ''):>9} {dk[0]:>8} {dk[1]:>6} "
              f"{r['restore_s_median']:>10} {r['import_s_median']:>9} {r['anon_added_mb_max']:>12} "
              f"{par.get('restore_s_max', ''):>14}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
