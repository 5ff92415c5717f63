"""KV across tensor-parallel degrees: a pool split over its KV heads on a devices exports each
shard's heads as its own pieces and chunks (no gather, no collective), and a pool on b devices
imports them, each device receiving its own heads; every pair a, b in {1, 2, 4} round-trips
exactly (float32) and across dtype, page size and lossy wire formats; a replicated pool sends
each head once; heads missing or twice are refused.

Runs in subprocesses with 8 fake CPU devices (the flag must be set before JAX starts): this
file is also the script (`python -m tests.kv.test_tensor_parallel CASE`)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support.paths import ROOT

DEGREES = (1, 2, 4)
L, D, PAGES = 2, 8, 12  # layers, head dim, pages per pool
T = 37  # tokens of the sequence (not a page multiple)


def _run_case(name: str) -> None:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", "tests.kv.test_tensor_parallel", name],
                       capture_output=True, text=True, timeout=600, env=env,
                       cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip().endswith(f"{name} ok"), (p.stdout[-3000:], p.stderr[-3000:])


@pytest.mark.parametrize("case", ["roundtrip_exact", "dtypes_and_formats", "refusals", "engines"])
def test_kv_across_tensor_parallel_degrees(case):
    _run_case(case)


# ---- the subprocess side ----------------------------------------------------------------

def _mesh_pool(k, v, devices, dtype):
    """A KVPool [L, K, P, S, D] on `devices`: split over K when it divides, else replicated."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pddjax.kv.pool import KVPool

    mesh = Mesh(np.array(devices), ("model",))
    spec = PartitionSpec(None, "model") if k.shape[1] % len(devices) == 0 else PartitionSpec()
    sh = NamedSharding(mesh, spec)
    return KVPool(jax.device_put(np.asarray(k, dtype), sh), jax.device_put(np.asarray(v, dtype), sh))


def _sender(K: int, a: int, page: int, dtype=np.float32, seed: int = 0):
    """A pool of degree a (devices 0..a-1) holding one sequence of T tokens in `pages`; its KV [L, T, K, D]."""
    import jax

    rng = np.random.default_rng(seed)
    shape = (L, K, PAGES, page, D)
    k, v = rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)
    pages = list(rng.permutation(np.arange(1, PAGES))[: -(-T // page)])
    pos = np.arange(T)
    ref_k = k[:, :, np.asarray(pages)[pos // page], pos % page].transpose(0, 2, 1, 3)  # [L, T, K, D]
    ref_v = v[:, :, np.asarray(pages)[pos // page], pos % page].transpose(0, 2, 1, 3)
    return _mesh_pool(k, v, jax.devices()[:a], dtype), pages, ref_k.astype(dtype), ref_v.astype(dtype)


def _receiver(K: int, b: int, page: int, dtype):
    import jax

    from pddjax.kv.pool import KVPool

    z = np.zeros((L, K, PAGES * 2, page, D), np.float32)
    pool = _mesh_pool(z, z, jax.devices()[4:4 + b], dtype)  # other devices than any sender's
    assert isinstance(pool, KVPool)
    return pool, list(range(3, 3 + -(-T // page)))


def _shard_ranges(pool) -> list[tuple[int, int]]:
    K = pool.k.shape[1]
    return sorted({s.index[1].indices(K)[:2] for s in pool.k.addressable_shards})


def _no_collectives(fn, *args) -> None:
    text = fn.lower(*args).compile().as_text()
    for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"):
        assert op not in text, f"{op} in the compiled KV copy"


def _send(pool, pages, a, fmt="native", page_tokens=16, chunk_bytes=600):
    """Export the sequence's tokens in two pieces (as P does, step by step) -> (chunks, pieces)."""
    from pddjax.kv import canonical
    from serving import kvwire

    ch = kvwire.Chunker("r", 0, T, chunk_bytes, fmt, page_tokens, tensor_parallel=a)
    msgs, pieces = [], []
    for lo, hi in ((0, 20), (20, T)):
        shards = canonical.export_shards(pool, pages, lo, hi, "fp")
        pieces.append(shards)
        msgs += ch.feed(shards, [7] if hi == T else None)
    return msgs, pieces


def _receive(msgs, pool, pages, out_dtype=None):
    from pddjax.kv import canonical
    from serving import kvwire

    asm = kvwire.Assembler("fp", out_dtype=out_dtype)
    for c in msgs:
        run = asm.feed(kvwire.cluster_pb2.KVChunk.FromString(c.SerializeToString()))
        if run is not None:
            pool = canonical.import_run(pool, run, pages, "fp")
    return pool, asm


def case_roundtrip_exact() -> None:
    import jax.numpy as jnp

    from pddjax.kv import canonical, copies

    for K, a, b in itertools.product((4, 2), DEGREES, DEGREES):
        pool, pages, ref_k, ref_v = _sender(K, a, page=4)
        ranges = _shard_ranges(pool)
        assert ranges == ([(0, K)] if K % a else [(i * K // a, (i + 1) * K // a) for i in range(a)])
        msgs, pieces = _send(pool, pages, a)
        for shards in pieces:  # one piece per shard's heads, each read from its own device
            assert [(r.head_start, r.head_end) for r in shards] == ranges
        blocks: dict[int, list] = {}
        for c in msgs:
            blocks.setdefault(c.start, []).append((c.head_start, c.head_end) if c.head_end else (0, K))
        assert len(blocks) > 2 and all(h == ranges for h in blocks.values()), blocks
        sent = sum(len(c.k) + len(c.v) for c in msgs)
        assert sent == 2 * L * T * K * D * 4, sent  # every head once: a replicated pool is not sent a times
        h = msgs[0].header
        assert (h.tensor_parallel, list(h.head_bounds)) == ((a, [r[0] for r in ranges] + [K]) if a > 1 else (0, []))
        sp, so = jnp.zeros(16, jnp.int32), jnp.zeros(16, jnp.int32)
        _no_collectives(copies._gather_jit, pool, sp, so)
        dest, dpages = _receiver(K, b, page=8, dtype=np.float32)
        sharding = dest.k.sharding
        dest, _ = _receive(msgs, dest, dpages)
        assert dest.k.sharding == sharding and _shard_ranges(dest) == _shard_ranges(_receiver(K, b, 8, np.float32)[0])
        back = canonical.export_run(dest, dpages, 0, T, "fp")
        assert back.k.shape == (L, T, K, D) and np.array_equal(back.k, ref_k) and np.array_equal(back.v, ref_v), \
            (K, a, b)
        for s in dest.k.addressable_shards:  # each receiver device holds exactly its heads' KV
            h0, h1 = s.index[1].indices(K)[:2]
            data = np.asarray(s.data)  # [L, h1 - h0, P, S, D]
            pos = np.arange(T)
            got = data[:, :, np.asarray(dpages)[pos // 8], pos % 8].transpose(0, 2, 1, 3)
            assert np.array_equal(got, ref_k[:, :, h0:h1])
        kk = canonical._place(canonical.as_pieces(back), "k", dest, 64)  # [L, 64, K, D] placed as dest's heads
        sp64 = jnp.zeros(64, jnp.int32)
        _no_collectives(copies._scatter_jit, dest, kk, kk, sp64, sp64)
    print("roundtrip_exact ok")


def case_dtypes_and_formats() -> None:
    import ml_dtypes

    from pddjax.kv import canonical

    bf16 = np.dtype(ml_dtypes.bfloat16)
    for K, a, b in itertools.product((4,), DEGREES, DEGREES):
        # float32 pool, page 4 -> bfloat16 pool, page 8 (native wire, cast on import)
        pool, pages, ref_k, ref_v = _sender(K, a, page=4, seed=1)
        msgs, _ = _send(pool, pages, a)
        dest, dpages = _receiver(K, b, page=8, dtype=bf16)
        dest, _ = _receive(msgs, dest, dpages)
        back = canonical.export_run(dest, dpages, 0, T, "fp")
        assert back.dtype == "bfloat16" and np.array_equal(back.k, ref_k.astype(bf16)), (K, a, b)
        # bfloat16 pool, page 8 -> float32 pool, page 4: exact
        pool, pages, ref_k, ref_v = _sender(K, a, page=8, dtype=bf16, seed=2)
        msgs, _ = _send(pool, pages, a)
        dest, dpages = _receiver(K, b, page=4, dtype=np.float32)
        dest, _ = _receive(msgs, dest, dpages)
        back = canonical.export_run(dest, dpages, 0, T, "fp")
        assert np.array_equal(back.v, ref_v.astype(np.float32)), (K, a, b)
    for (a, b), fmt in itertools.product(((2, 4), (4, 1), (1, 2)), ("int8", "fp8+zstd", "bf16+zstd")):
        # lossy formats per head range: int8 / fp8 scales are per (K/V, layer, page, head)
        pool, pages, ref_k, ref_v = _sender(4, a, page=4, seed=3)
        msgs, _ = _send(pool, pages, a, fmt=fmt, page_tokens=4)
        dest, dpages = _receiver(4, b, page=8, dtype=np.float32)
        dest, _ = _receive(msgs, dest, dpages, out_dtype="float32")
        back = canonical.export_run(dest, dpages, 0, T, "fp")
        for got, ref in ((back.k, ref_k), (back.v, ref_v)):
            if fmt == "int8":  # |error| <= scale / 2, scale = amax / 127 of each page x head
                pos_page = np.arange(T) // 4
                amax = np.stack([np.abs(ref[:, pos_page == g]).max(axis=(1, 3)) for g in range(pos_page[-1] + 1)],
                                axis=1)  # [L, G, K]
                bound = (amax / 127 / 2)[:, pos_page, :, None] * (1 + 1e-6)
                assert np.all(np.abs(got - ref) <= bound), (a, b, fmt)
            else:
                np.testing.assert_allclose(got, ref, rtol=2 ** -3 if "fp8" in fmt else 2 ** -8, atol=1e-2)
    print("dtypes_and_formats ok")


def case_refusals() -> None:
    import dataclasses

    from pddjax.kv import canonical
    from serving import kvwire

    pool, pages, _, _ = _sender(4, 2, page=4)
    msgs, pieces = _send(pool, pages, 2)
    assert [(c.head_start, c.head_end) for c in msgs[:2]] == [(0, 2), (2, 4)]

    def restamp(cs):
        out = []
        for i, c in enumerate(cs):
            c = kvwire.cluster_pb2.KVChunk.FromString(c.SerializeToString())
            if i == 0 and not c.HasField("header"):
                c.header.CopyFrom(msgs[0].header)
            c.seq = i
            if i:
                c.ClearField("header")
            c.crc32 = kvwire.chunk_crc(c)
            out.append(c)
        return out

    def refused(cs, words):
        asm = kvwire.Assembler("fp")
        try:
            for c in cs:
                asm.feed(c)
        except kvwire.WireError as e:
            assert e.code_name == "DATA_LOSS" and words in str(e), str(e)
            return
        raise AssertionError(f"accepted a stream where {words}")

    refused(restamp([msgs[0]] + msgs[2:]), "never arrived")  # heads [2, 4) of the first block dropped
    cut = restamp(msgs[:-1])  # the last block's heads [2, 4) dropped, its heads [0, 2) marked last
    cut[-1].last = True
    cut[-1].crc32 = kvwire.chunk_crc(cut[-1])
    refused(cut, "are missing")
    refused(restamp([msgs[0], msgs[0]] + msgs[1:]), "arrive twice")
    odd = restamp(msgs)
    odd[1].head_start, odd[1].head_end = 1, 4
    odd[1].crc32 = kvwire.chunk_crc(odd[1])
    refused(odd, "not one of the sender's ranges")
    bad = restamp(msgs)
    bad[0].header.ClearField("head_bounds")
    bad[0].header.head_bounds.extend([0, 3])  # a split that does not reach the 4 heads
    bad[0].crc32 = kvwire.chunk_crc(bad[0])
    try:
        kvwire.Assembler("fp").feed(bad[0])
        raise AssertionError("accepted a split short of the heads")
    except kvwire.WireError as e:
        assert e.code_name == "INVALID_ARGUMENT" and "does not cut" in str(e)
    tamper = restamp(msgs)
    tamper[1].head_start = 0  # the crc covers the head range
    try:
        asm = kvwire.Assembler("fp")
        asm.feed(tamper[0])
        asm.feed(tamper[1])
        raise AssertionError("a flipped head range passed the checksum")
    except kvwire.WireError as e:
        assert "checksum" in str(e)
    # the import refuses pieces that leave a head out or hold one twice, one sentence each
    dest, dpages = _receiver(4, 4, page=8, dtype=np.float32)
    first = pieces[0]
    for runs, words in (([first[0]], "are missing"), ([first[0], first[0], first[1]], "arrive twice"),
                        ([first[0], dataclasses.replace(first[1], start=1)], "cover tokens")):
        try:
            canonical.import_run(dest, runs, dpages, "fp")
            raise AssertionError(f"imported pieces where {words}")
        except canonical.KVImportError as e:
            assert words in str(e), str(e)
    print("refusals ok")


def case_engines() -> None:
    """Paged engines (tiny: 2 KV heads, so TP=4 holds them replicated): P at degree a prefills,
    its shards' chunks go to a decode engine at degree b (another page size), which decodes
    the reference's greedy tokens, for every pair."""
    from pddjax.engines.paged_engine import EngineConfig, PagedEngine
    from pddjax.engines.reference import ReferenceEngine
    from pddjax.model.registry import load_model
    from pddjax.model.sampling_params import SamplingParams
    from serving import kvwire

    m = load_model("tiny")
    prompt = np.random.default_rng(0).integers(3, 512, 40).tolist()
    want = ReferenceEngine(m.config, m.weights).generate(prompt, SamplingParams(), 8, ()).token_ids
    base = dict(max_step_tokens=64, max_rows=2, prefix_cache=False)
    prefill = {n: PagedEngine(m.config, m.weights, m.fingerprint,
                              EngineConfig(page_size=16, num_pages=16, tensor_parallel=n, **base)) for n in DEGREES}
    decode = {n: PagedEngine(m.config, m.weights, m.fingerprint,
                             EngineConfig(page_size=8, num_pages=32, tensor_parallel=n, **base)) for n in DEGREES}
    for a, b in itertools.product(DEGREES, DEGREES):
        rid, P, D = f"r{a}{b}", prefill[a], decode[b]
        P.add(rid, prompt, SamplingParams(), 1, (), hold_on_finish=True)
        first = None
        while P.has_work():
            first = next((ev.token for ev in P.step()), first)
        pieces = P.export_kv_shards(rid, 0, len(prompt))
        assert [(r.head_start, r.head_end) for r in pieces] == ([(0, 1), (1, 2)] if a == 2 else [(0, 2)])
        D.add(rid, prompt, SamplingParams(), 8, ())
        asm = kvwire.Assembler(m.fingerprint)
        for c in kvwire.chunks(rid, pieces, 0, [first], 1024, tensor_parallel=a):
            run = asm.feed(c)
            if run is not None:
                D.import_kv(rid, run)
        D.append_tokens(rid, 0, [first])
        got = [first]
        while D.has_work():
            got += [ev.token for ev in D.step()]
        assert got == want, (a, b, got, want)
        P.release(rid, cache=False)
        D.check_integrity()
    print("engines ok")


if __name__ == "__main__":
    from pddjax.model.jax_setup import configure

    configure()
    {"roundtrip_exact": case_roundtrip_exact, "dtypes_and_formats": case_dtypes_and_formats,
     "refusals": case_refusals, "engines": case_engines}[sys.argv[1]]()
