"""One-shot GPU check of the Pallas ragged paged attention kernel; prints JSON.

1. Correctness: the compiled kernel (not interpret mode) against the XLA reference on mixed
   ragged batches (decode, extend, prefill with cached prefix, empty rows), f32 and bf16.
2. Decode bandwidth: bytes of KV actually needed (sum(kv_len) * KH * D * 2 (K, V) * itemsize)
   per second, as a fraction of the card's HBM peak (looked up from device_kind), with the XLA
   reference's time next to it. One layer of the real model's shape (9 q / 3 kv heads, D = 64).
3. Optionally (--bench-engine) runs `pddjax bench engine --attention pallas` on the real model.

  python tools/gpu_attention_check.py [--json out.json] [--bench-engine]
  python tools/gpu_attention_check.py --dry-run   # CPU, interpret mode, tiny shapes
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pddjax.model.attention.pallas_paged import choose_blocks, paged_attention_pallas
from pddjax.model.attention.ragged import Ragged
from pddjax.model.attention.xla_paged import paged_attention_xla

# HBM peak bytes/s by device_kind substring (first match wins; most specific first).
HBM_PEAK = [
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM5 80GB HBM3
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
]
TOL = {"float32": (2e-5, 0.0), "bfloat16": (1e-2, 1.6e-2)}  # (atol, rtol), as in the tests


def hbm_peak(kind: str) -> float | None:
    return next((bw for key, bw in HBM_PEAK if key.lower() in kind.lower()), None)


def flat(fn, *, max_q_len: int, sm_scale: float):
    """fn(q, k, v, rows) called as fn(q, k, v, cu_q_lens, kv_lens, page_tables), what ragged_batch gives."""
    return lambda q, k, v, cu, kv, pt: fn(q, k, v, Ragged(cu, kv, pt, max_q_len, sm_scale))


def ragged_batch(rng, *, rows, max_q, ctx, heads, kv_heads, head_dim, page_size, dtype, decode_only):
    """Packed queries and a scattered page pool; every row's kv_len <= ctx."""
    if decode_only:
        q_lens = np.ones(rows, np.int32)
        kv_lens = np.full(rows, ctx, np.int32)
    else:
        kinds = rng.integers(0, 4, rows)  # 0 empty, 1 decode, 2 extend, 3 prefill
        q_lens = np.where(kinds == 0, 0, np.where(kinds == 1, 1, rng.integers(2, max_q + 1, rows)))
        kv_lens = np.where(q_lens > 0, q_lens + rng.integers(0, ctx - max_q + 1, rows), 0)
    max_pages = -(-ctx // page_size)
    num_pages = 1 + rows * max_pages
    perm = 1 + rng.permutation(rows * max_pages)
    pt = np.zeros((rows, max_pages), np.int32)
    for r in range(rows):
        n = -(-int(kv_lens[r]) // page_size)
        pt[r, :n] = perm[r * max_pages: r * max_pages + n]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens = int(cu[-1]) + 3  # a few padding tokens
    q = rng.standard_normal((tokens, heads, head_dim), np.float32)
    k = rng.standard_normal((kv_heads, num_pages, page_size, head_dim), np.float32)
    v = rng.standard_normal((kv_heads, num_pages, page_size, head_dim), np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(cu), jnp.asarray(kv_lens.astype(np.int32)), jnp.asarray(pt))


def timed(fn, args, reps):
    """Seconds per call: `reps` calls chained inside one jit (q depends on the last output)."""
    def loop(q, *rest):
        def body(_, q):
            return q + (1e-3 * fn(q, *rest)).astype(q.dtype)
        return jax.lax.fori_loop(0, reps, body, q)
    f = jax.jit(loop)
    f(*args).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        f(*args).block_until_ready()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpret mode, tiny shapes")
    ap.add_argument("--json", help="also write the report here")
    ap.add_argument("--bench-engine", action="store_true", help="run pddjax bench engine too")
    a = ap.parse_args()

    backend = jax.default_backend()
    interpret = a.dry_run or backend == "cpu"
    kind = jax.devices()[0].device_kind
    heads, kv_heads, head_dim, page_size = 9, 3, 64, 16
    report: dict = {"backend": backend, "device_kind": kind, "interpret": interpret,
                    "hbm_peak_bytes_per_s": hbm_peak(kind), "check": [], "decode": []}
    rng = np.random.default_rng(0)
    # --dry-run interprets the GPU block choice (tile sizes, kv splits) on the CPU.
    pallas = functools.partial(paged_attention_pallas, interpret=interpret,
                               backend="gpu" if a.dry_run else None)

    # 1. correctness of the compiled kernel
    check_shapes = dict(rows=4, max_q=16, ctx=256) if a.dry_run else dict(rows=16, max_q=128, ctx=1024)
    ok = True
    for dtype in ("float32", "bfloat16"):
        for ps in ((16,) if a.dry_run else (16, 32)):
            args = ragged_batch(rng, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=ps,
                                dtype=dtype, decode_only=False, **check_shapes)
            kw = dict(max_q_len=check_shapes["max_q"], sm_scale=head_dim**-0.5)
            got = np.asarray(jax.jit(flat(pallas, **kw))(*args).astype(jnp.float32))
            want = np.asarray(jax.jit(flat(paged_attention_xla, **kw))(*args).astype(jnp.float32))
            atol, rtol = TOL[dtype]
            err = np.abs(got - want)
            passed = bool(np.isfinite(got).all() and (err <= atol + rtol * np.abs(want)).all())
            ok &= passed
            report["check"].append({"dtype": dtype, "page_size": ps, "max_abs_err": float(err.max()),
                                    "atol": atol, "rtol": rtol, "ok": passed})

    # 2. decode bandwidth (one layer)
    grid = [(2, 256)] if a.dry_run else [(1, 4096), (8, 2048), (32, 1024), (64, 4096), (128, 2048)]
    reps = 2 if a.dry_run else 50
    for dtype in ("bfloat16",) if a.dry_run else ("bfloat16", "float32"):
        for rows, ctx in grid:
            args = ragged_batch(rng, rows=rows, max_q=1, ctx=ctx, heads=heads, kv_heads=kv_heads,
                                head_dim=head_dim, page_size=page_size, dtype=dtype, decode_only=True)
            kw = dict(max_q_len=1, sm_scale=head_dim**-0.5)
            t_pallas = timed(flat(pallas, **kw), args, reps)
            t_xla = timed(flat(paged_attention_xla, **kw), args, reps)
            kv_bytes = int(np.asarray(args[4]).sum()) * kv_heads * head_dim * 2 * jnp.dtype(dtype).itemsize
            peak = report["hbm_peak_bytes_per_s"]
            report["decode"].append({
                "dtype": dtype, "batch": rows, "ctx": ctx, "kv_bytes": kv_bytes,
                "pallas_us": t_pallas * 1e6, "xla_us": t_xla * 1e6,
                "pallas_gb_per_s": kv_bytes / t_pallas / 1e9, "xla_gb_per_s": kv_bytes / t_xla / 1e9,
                "pallas_frac_of_peak": (kv_bytes / t_pallas / peak) if peak else None,
            })
    report["blocks_decode"] = str(choose_blocks(
        "gpu" if a.dry_run else backend, page_size=page_size, group=heads // kv_heads, max_q_len=1,
        head_dim=head_dim, num_rows=grid[-1][0], num_kv_heads=kv_heads,
        max_pages=-(-grid[-1][1] // page_size)))

    # 3. engine benchmark (optional; the CLI belongs to the engines issue)
    if a.bench_engine and not a.dry_run:
        cmd = [sys.executable, "-m", "serving.cli", "bench", "engine", "--model", "smollm2-135m",
               "--attention", "pallas", "--json", "/tmp/bench_engine_pallas.json"]
        # goal on an accelerator: extend_ms["64"] / decode_ms["1"] <= 1.3
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480)
        entry = {"cmd": " ".join(cmd), "rc": proc.returncode, "tail": proc.stdout[-2000:] + proc.stderr[-2000:]}
        if proc.returncode == 0:
            with open("/tmp/bench_engine_pallas.json") as f:
                entry["result"] = res = json.load(f)
            try:
                entry["extend64_over_decode1"] = res["extend_ms"]["64"] / res["decode_ms"]["1"]
            except (KeyError, TypeError, ZeroDivisionError):
                pass
        report["bench_engine"] = entry

    report["ok"] = ok
    text = json.dumps(report, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
