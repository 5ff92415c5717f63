"""Build everything an engine's steps and KV copies will run, before it serves.

`precompile(engine)` AOT-compiles (or loads from JAX's persistent compilation cache on disk)
every member of the engine's stated step shape set (`buckets.bucket_set`) and runs the KV
gather / scatter once per token bucket a sequence can need (their jitted variants), so that
from the moment a service reports SERVING nothing compiles: `pddjax_jit_compiles_after_ready`
stays 0 (serving/engine/worker.py). The step executable LRU is raised to hold the whole set.
A tensor-parallel engine builds the same set, each member its sharded executable
(`engine.layout`), and the KV copies on its sharded pool.
"""

from __future__ import annotations

import time

import numpy as np

from pddjax.engines import buckets, step
from pddjax.kv.allocator import NULL_PAGE
from pddjax.kv.canonical import export_run, import_run
from pddjax.model.paged import PackedBatch
from pddjax.sizes import pow2_at_least

HEADROOM = 16  # LRU room beyond the set (test-only variants such as return_logits)
KV_MIN_BUCKET = 16  # kv.canonical pads a run's tokens to 16, 32, 64, ...


def dummy_batch(shape: buckets.Shape) -> tuple[PackedBatch, tuple]:
    """An all-padding batch of `shape` (every slot page 0, the scratch page) and its sampling
    arrays, numpy with the dtypes `PagedEngine._build` / `_sampling_arrays` give: the very
    signature the serving loop calls the step with, so its calls hit what this builds."""
    T, B, MP, _ = shape
    z = np.zeros
    batch = PackedBatch(z(T, np.int32), z(T, np.int32), np.full(T, NULL_PAGE, np.int32), z(T, np.int32),
                        z(B + 1, np.int32), z(B, np.int32), z((B, MP), np.int32), z(B, np.int32))
    sampling = (z(B, np.int32), z(B, np.int32), z(B, np.float32), z(B, np.int32),
                np.ones(B, np.float32))  # seeds, steps, temperature, top_k, top_p
    return batch, sampling


def kv_buckets(engine) -> list[int]:
    """Token counts the KV copies pad to, up to the longest sequence this engine can hold."""
    cfg = engine.config
    longest = min(engine.cfg.max_context, (cfg.num_pages - 1) * cfg.page_size)
    return buckets.ladder(KV_MIN_BUCKET, pow2_at_least(longest, KV_MIN_BUCKET), 2)


def precompile(engine) -> tuple[int, float]:
    """-> (variants built or loaded, seconds). Leaves the pool's real pages untouched: the KV
    copies read and write only page 0 (scratch)."""
    t0 = time.perf_counter()
    execs = step.executables()
    if execs.capacity < len(engine.shapes) + HEADROOM:
        execs.resize(len(engine.shapes) + HEADROOM)
    for shape in engine.shapes:
        batch, sampling = dummy_batch(shape)
        step.build_step(engine.weights, engine.cfg, batch, engine.pool, sampling, max_q_len=shape[3],
                        impl=engine.config.attention, layout=engine.layout)
    step.release_tracing_caches()  # (this drops jitted functions' caches too: the KV copies come after)
    S = engine.config.page_size
    for n in kv_buckets(engine):
        pages = [NULL_PAGE] * (-(-n // S))
        run = export_run(engine.pool, pages, 0, n, engine.fingerprint)  # k, v: [L, n, K, D] of page 0
        engine.pool = engine.layout.put_pool(import_run(engine.pool, run, pages, engine.fingerprint))  # (host casts)
    return len(engine.shapes) + 2 * len(kv_buckets(engine)), time.perf_counter() - t0
