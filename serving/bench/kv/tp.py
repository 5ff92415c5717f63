"""`pddjax bench kv-tp` (or `python -m serving.bench.kv.tp`): the KV that crosses between a
prefill pool of tensor-parallel degree a and a decode pool of degree b, for every pair.

For each pair (a, b) of `--degrees` (both admitted by the model: KV heads split when they divide
by the degree, else replicated), a pool on a fake CPU devices holds one sequence of `--tokens`
tokens of random KV (the model's L, K, D); the real wire path moves it: `export_shards` (each
device gathers its heads, each shard read on its own) -> `kvwire.Chunker` (one chunk per head
range per token block) -> serialized -> `kvwire.Assembler` -> `import_run` into a pool on b other
devices (each device given its heads). Per pair: the head ranges sent, chunks, KV payload
bytes per token (k + v + scales) against the canonical KV (one copy of every head: 1.000 means no
head was sent twice, the check for replicated pools), the protobuf bytes per token, what each
receiving device is given per token, and whether the KV read back equals what was sent. The
devices are fake CPU devices sharing this machine's cores: the milliseconds are the host path's
cost only, not a device transfer.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import numpy as np


def register(bsub) -> None:
    p = bsub.add_parser("kv-tp", help="KV bytes moved per token between tensor-parallel degrees a -> b")
    add_args(p)
    p.set_defaults(func=lambda a: run(a))


def add_args(p) -> None:
    p.add_argument("--model", default="tiny", help="a named model config (only its shapes are used)")
    p.add_argument("--kv-heads", type=int, help="override the model's KV heads (shapes only: query heads follow)")
    p.add_argument("--degrees", default="1,2,4", help="tensor-parallel degrees; every pair a -> b is measured")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-wire", default="native", help="comma-separated wire formats (pddjax.kv.codec)")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--json", help="write the figures to this file")


def _pool(cfg, devices, num_pages: int, page: int, rng):
    """A KVPool [L, K, P, S, D] float32 of random values on `devices` (split over K when it divides)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pddjax.kv.pool import KVPool

    shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page, cfg.head_dim)
    split = cfg.num_kv_heads % len(devices) == 0
    sh = NamedSharding(Mesh(np.array(devices), ("model",)), PartitionSpec(None, "model") if split else PartitionSpec())
    return KVPool(*(jax.device_put(rng.standard_normal(shape, np.float32), sh) for _ in range(2)))


def measure(cfg, a: int, b: int, tokens: int, page: int, fmt: str, chunk_bytes: int) -> dict:
    import jax

    from pddjax.kv import canonical
    from serving import kvwire
    from serving.pb import cluster_pb2

    devices, rng = jax.devices(), np.random.default_rng(a * 10 + b)
    n_pages = -(-tokens // page)
    src = _pool(cfg, devices[:a], n_pages + 1, page, rng)
    dst = _pool(cfg, devices[len(devices) - b:], n_pages + 1, page, rng)
    pages = list(range(1, n_pages + 1))
    t0 = time.perf_counter()
    pieces = canonical.export_shards(src, pages, 0, tokens, "fp")
    msgs = [c.SerializeToString() for c in kvwire.Chunker("r", 0, tokens, chunk_bytes, fmt, page, a).feed(pieces, [1])]
    asm = kvwire.Assembler("fp", out_dtype="float32")
    for m in msgs:
        run = asm.feed(cluster_pb2.KVChunk.FromString(m))
        if run is not None:
            dst = canonical.import_run(dst, run, pages, "fp")
    jax.block_until_ready(dst.k)
    ms = 1e3 * (time.perf_counter() - t0)
    sent, back = canonical.join_heads(pieces), canonical.export_run(dst, pages, 0, tokens, "fp")
    L, K, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    canonical_bytes = 2 * L * K * D * 4  # float32 K and V of every head, once
    per_device = sorted({s.index[1].indices(K)[:2] for s in dst.k.addressable_shards})
    return {"a": a, "b": b, "kv_wire": fmt, "sent_ranges": [(r.head_start, r.head_end) for r in pieces],
            "receiver_ranges": per_device, "chunks": len(msgs),
            "payload_bytes_per_token": asm.bytes / tokens, "wire_bytes_per_token": sum(map(len, msgs)) / tokens,
            "canonical_bytes_per_token": canonical_bytes,
            "duplication": asm.bytes / (canonical_bytes * tokens) if fmt == "native" else None,
            "per_receiver_device_bytes_per_token": 2 * L * (per_device[0][1] - per_device[0][0]) * D * 4,
            "exact": bool(np.array_equal(back.k, sent.k) and np.array_equal(back.v, sent.v)) if fmt == "native"
            else None,  # a lossy format is not meant to be
            "ms": ms}


def run(args) -> int:
    from pddjax.engines.engine_config import degree_problem
    from pddjax.model.config import NAMED_CONFIGS
    from pddjax.model.jax_setup import configure

    degrees = [int(x) for x in args.degrees.split(",")]
    if args.model not in NAMED_CONFIGS:
        raise SystemExit(f"--model must be one of {', '.join(NAMED_CONFIGS)} (only its shapes are used)")
    cfg = NAMED_CONFIGS[args.model]
    if args.kv_heads:
        cfg = cfg.replace(num_kv_heads=args.kv_heads, num_heads=args.kv_heads * cfg.group_size)
    for n in degrees:
        problem = degree_problem(n, cfg.num_heads, cfg.num_kv_heads)
        if problem:
            raise SystemExit(f"{args.model}: {problem}")
    configure("cpu", devices=2 * max(degrees))  # sender and receiver on disjoint fake devices
    import jax

    if len(jax.devices()) < 2 * max(degrees):
        raise SystemExit(f"{len(jax.devices())} devices, {2 * max(degrees)} needed: run with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={2 * max(degrees)}")
    rows = []
    for fmt in args.kv_wire.split(","):
        for a, b in itertools.product(degrees, degrees):
            measure(cfg, a, b, args.tokens, args.page_size, fmt, args.chunk_bytes)  # compiles the copies
            rows.append(measure(cfg, a, b, args.tokens, args.page_size, fmt, args.chunk_bytes))
    print(f"{args.model}: L={cfg.num_layers} K={cfg.num_kv_heads} D={cfg.head_dim}, {args.tokens} tokens, page "
          f"{args.page_size}; canonical float32 KV {rows[0]['canonical_bytes_per_token']} B/token")
    print("| a -> b | wire | heads sent per block | receiver heads per device | chunks | payload B/token | "
          "protobuf B/token | x canonical | B/token per receiver device | exact | ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        dup = "-" if r["duplication"] is None else f"{r['duplication']:.3f}"
        print(f"| {r['a']} -> {r['b']} | {r['kv_wire']} | {_ranges(r['sent_ranges'])} | "
              f"{_ranges(r['receiver_ranges'])} | {r['chunks']} | {r['payload_bytes_per_token']:.1f} | "
              f"{r['wire_bytes_per_token']:.1f} | {dup} | {r['per_receiver_device_bytes_per_token']} | "
              f"{ {True: 'yes', False: 'NO', None: 'lossy'}[r['exact']]} | {r['ms']:.1f} |")
    if args.json:
        from pddjax.report import write_figures

        write_figures({"model": args.model, "tokens": args.tokens, "page_size": args.page_size, "pairs": rows},
                      args.json)
    return 0 if all(r["exact"] is not False for r in rows) else 1


def _ranges(ranges) -> str:
    return " ".join(f"[{h0},{h1})" for h0, h1 in ranges)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
