"""The native CPU kernels of another git revision beside this tree's, in one process: the real
model's paged forward per step shape compiled once against each build, steps interleaved, the
median per side, and whether the logits are bit for bit the same.

    python -m tools.kernel_ab --rev HEAD~1 [--model smollm2-135m] [--context 256]
        [--shapes 1,1,32,1 4,4,32,1 8,8,32,1 16,16,32,1 32,32,32,1 16,1,32,16 64,1,32,64]
        [--reps 11] [--json F]

The other revision's `native/*.cc` and headers (`git show REV:path`) are built with this tree's
compiler command into a temporary folder and registered under their own target names; the
"old" forward is traced while `native_paged` names those targets. Both sides run this tree's
Python (the model, the weights in panels, the attention's call), so only the kernels differ.
Alternating `bench engine` runs of two checkouts met this machine's minute-to-minute moves
(1.2-1.5x) more than a kernel change of 5-10%; interleaving in one process does not. Run it on a
quiet machine, under `nice -n -20`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import tempfile

DEFAULT_SHAPES = "1,1,32,1 4,4,32,1 8,8,32,1 16,16,32,1 32,32,32,1 16,1,32,16 64,1,32,64"
SUFFIX = "_other"  # the other revision's targets: pddjax_paged_attention_other, pddjax_gemm_other


def build_other(rev: str, folder: str) -> str:
    """The native sources and headers of `rev` built into `folder` -> the library's path."""
    from pddjax.model.attention import native_paged

    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    sources = []
    for path in native_paged.SOURCES + native_paged.HEADERS:
        rel = os.path.relpath(path, root)
        shown = subprocess.run(["git", "show", f"{rev}:{rel}"], capture_output=True, cwd=root)
        if shown.returncode != 0:
            raise SystemExit(f"kernel_ab: git has no {rel} at {rev!r}: {shown.stderr.decode().strip()[:300]}")
        text = shown.stdout
        local = os.path.join(folder, os.path.basename(path))
        with open(local, "wb") as f:
            f.write(text)
        if path in native_paged.SOURCES:
            sources.append(local)
    out = os.path.join(folder, "libother.so")
    cxx = native_paged._compiler()
    if cxx is None:
        raise SystemExit("kernel_ab: no C++ compiler (set CXX or install g++)")
    done = subprocess.run(native_paged._command(cxx, out, tuple(sources)), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"kernel_ab: {rev}'s kernels did not build: {done.stderr.strip()[-2000:]}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.kernel_ab", description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the git revision whose native kernels run on the 'old' side")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES.split())
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--num-pages", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from pddjax.model.jax_setup import configure

    configure()
    import jax
    import numpy as np

    from pddjax.kv.pool import KVPool
    from pddjax.model import weights as wmod
    from pddjax.model.attention import native_paged
    from pddjax.model.paged import forward_paged
    from pddjax.model.registry import load_model
    from tools.attention_ab import interleaved
    from tools.step_trace import _batch

    if not native_paged.available():
        raise SystemExit("kernel_ab: this tree's native kernels could not be built here (the log says why)")
    names = {"old": (native_paged.TARGET + SUFFIX, native_paged.GEMM_TARGET + SUFFIX),
             "new": (native_paged.TARGET, native_paged.GEMM_TARGET)}
    with tempfile.TemporaryDirectory(prefix="pddjax-kernel-ab-") as folder:
        lib = ctypes.cdll.LoadLibrary(build_other(args.rev, folder))
    jax.ffi.register_ffi_target(names["old"][0], jax.ffi.pycapsule(lib.PddjaxPagedAttention), platform="cpu")
    jax.ffi.register_ffi_target(names["old"][1], jax.ffi.pycapsule(lib.PddjaxGemm), platform="cpu")

    model = load_model(args.model)
    cfg = model.config
    weights = wmod.cast(wmod.in_panels(wmod.for_engine(model.weights, one_device=True)), np.float32)
    pool_shape = (cfg.num_layers, cfg.num_kv_heads, args.num_pages, args.page_size, cfg.head_dim)
    results = []
    for text in args.shapes:
        T, B, MP, Q = (int(x) for x in text.split(","))
        batch = _batch(T, B, MP, args.context, args.page_size, args.num_pages, cfg.vocab_size)
        sides = {}
        for side, (attention, gemm) in names.items():
            pool = KVPool(jax.random.normal(jax.random.key(0), pool_shape),
                          jax.random.normal(jax.random.key(1), pool_shape))
            fwd = jax.jit(lambda w, b, p, Q=Q: forward_paged(w, cfg, b, p, max_q_len=Q, impl="native"),
                          donate_argnums=(2,))
            native_paged.TARGET, native_paged.GEMM_TARGET = attention, gemm
            try:
                compiled = fwd.lower(weights, batch, pool).compile()
            finally:
                native_paged.TARGET, native_paged.GEMM_TARGET = names["new"]
            if f'custom_call_target="{attention}"' not in compiled.as_text():
                raise SystemExit(f"kernel_ab: the {side} side's forward does not call {attention}")
            sides[side] = [compiled, pool, [], None, weights]
        ms = interleaved(sides, batch, args.reps)
        row = {"shape": [T, B, MP, Q], "ms": {k: round(v, 2) for k, v in ms.items()},
               "new_over_old": round(ms["new"] / ms["old"], 3),
               "bitwise_same": bool(np.array_equal(sides["old"][3], sides["new"][3]))}
        results.append(row)
        print(f"[{T}, {B}, {MP}, {Q}] {args.rev} {ms['old']:.1f} ms  this tree {ms['new']:.1f} ms  "
              f"new/old {row['new_over_old']:.3f}  logits bit for bit the same: {row['bitwise_same']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "rev": args.rev, "context": args.context, "shapes": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
