"""The machine's limits and each engine step's floor under them, for `pddjax bench engine`.

Limits, measured in the same run as the steps (so a busy machine lowers both alike):
  read_gb_s      a jitted sum over a 1 GiB float32 array (every byte read once), best of 5
  matmul_gflop_s a 2048^3 float32 matmul, best of 5

A step's floor is the larger of its bytes over `read_gb_s` and its FLOPs over `matmul_gflop_s`:
  bytes  every layer's weights and the LM head read once (the embedding table's few rows and the
         norms are noise), plus each row's KV context read once (K and V, every layer);
  FLOPs  2 per weight per token through the projections and the LM head (logits at the rows'
         last tokens only), plus attention: 4 * H * D per (query, key) pair per layer.
`fraction` = measured / floor: 1.0 is the machine's limit, 2.0 twice as slow as it allows.
"""

from __future__ import annotations

import time

import numpy as np


def machine_limits(repeats: int = 5) -> dict:
    import jax
    import jax.numpy as jnp

    def best(fn, *args) -> float:
        fn(*args).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(*args).block_until_ready()
            times.append(time.perf_counter() - t0)
        return min(times)

    big = jnp.ones((1 << 28,), jnp.float32)  # 1 GiB
    read = best(jax.jit(jnp.sum), big)
    del big
    n = 2048
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32))
    mm = best(jax.jit(jnp.matmul), a, a)
    return {"read_gb_s": round((1 << 30) / read / 1e9, 2), "matmul_gflop_s": round(2 * n**3 / mm / 1e9, 1)}


def _weight_counts(cfg) -> tuple[int, int]:
    """(weights in the layers' projections, weights in the LM head)."""
    E, H, K, D, F = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_hidden
    per_layer = E * (H + 2 * K) * D + H * D * E + 3 * E * F
    return cfg.num_layers * per_layer, E * cfg.vocab_size


def step_floor(cfg, dtype_bytes: int, limits: dict, *, tokens: int, rows: int, context: int,
               pairs: int) -> dict:
    """The floor of a step that runs `tokens` tokens through the layers in `rows` rows with
    `context` KV positions each, `pairs` (query, key) pairs of attention per layer in all."""
    layers_w, head_w = _weight_counts(cfg)
    kv_bytes = rows * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    nbytes = (layers_w + head_w) * dtype_bytes + kv_bytes
    flops = 2 * layers_w * tokens + 2 * head_w * rows + 4 * cfg.num_heads * cfg.head_dim * pairs * cfg.num_layers
    read_ms = 1e3 * nbytes / (limits["read_gb_s"] * 1e9)
    compute_ms = 1e3 * flops / (limits["matmul_gflop_s"] * 1e9)
    return {"bytes_mb": round(nbytes / 1e6, 1), "gflop": round(flops / 1e9, 3), "read_ms": round(read_ms, 2),
            "compute_ms": round(compute_ms, 2), "floor_ms": round(max(read_ms, compute_ms), 2)}


def roofline(figures: dict, cfg, dtype_bytes: int, limits: dict, context: int) -> dict:
    """Floors and fractions for the figures of `bench engine` (decode_ms, extend_ms, prefill)."""
    out = {"decode": {}, "extend": {}}
    for b, ms in figures["decode_ms"].items():
        b = int(b)
        f = step_floor(cfg, dtype_bytes, limits, tokens=b, rows=b, context=context, pairs=b * context)
        out["decode"][str(b)] = {**f, "measured_ms": ms, "fraction": round(ms / f["floor_ms"], 2)}
    for k, ms in figures["extend_ms"].items():
        k = int(k)
        pairs = k * context + k * (k + 1) // 2
        f = step_floor(cfg, dtype_bytes, limits, tokens=k, rows=1, context=context + k, pairs=pairs)
        out["extend"][str(k)] = {**f, "measured_ms": ms, "fraction": round(ms / f["floor_ms"], 2)}
    n, rate = figures.get("prefill_tokens"), figures.get("prefill_tokens_per_s")
    if n and rate:
        f = step_floor(cfg, dtype_bytes, limits, tokens=n, rows=1, context=n, pairs=n * (n + 1) // 2)
        ms = 1e3 * n / rate
        out["prefill"] = {**f, "measured_ms": round(ms, 2), "fraction": round(ms / f["floor_ms"], 2),
                          "of_matmul_peak": round(f["compute_ms"] / ms, 3)}
    return out


def table(roof: dict) -> str:
    lines = ["| step | measured ms | floor ms (read / compute) | fraction |", "|---|---|---|---|"]
    for kind in ("decode", "extend"):
        for n, f in roof[kind].items():
            lines.append(f"| {kind} {n} | {f['measured_ms']} | {f['floor_ms']} ({f['read_ms']} / {f['compute_ms']}) | "
                         f"{f['fraction']}x |")
    if "prefill" in roof:
        f = roof["prefill"]
        lines.append(f"| prefill | {f['measured_ms']} | {f['floor_ms']} ({f['read_ms']} / {f['compute_ms']}) | "
                     f"{f['fraction']}x ({100 * f['of_matmul_peak']:.0f}% of matmul peak) |")
    return "\n".join(lines)
