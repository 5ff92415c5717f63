"""`pddjax bench handoff`: PDD's handoff microbenchmark, side by side in one run.

Handing MD the N tokens RLD generated, two ways, over the same jittery emulated WAN:
- token_ids: one `HandoffTokensRequest` (N token IDs) crosses the WAN, then MD runs one
  extend-decode step over them (recomputing their KV locally) and has its next token;
- kv: the same N tokens' KV crosses the WAN as `KVChunk` messages (canonical form, MD's
  dtype), then MD checks and imports it into its pool (the report's "device memory copies").
Beside them, the KV path per wire format (`--kv-wire`, pddjax.kv.codec; issue 19): per format
the N tokens' KV (`handoff_kv`) and the KV transfer P -> MD that precedes a handoff, the
256-token prompt's KV (`prompt_kv`), each encoded by `kvwire.Chunker` as P does, decoded into
MD's dtype by `kvwire.Assembler` and imported. Latency = first byte sent -> MD ready (decode and
import included); encode_ms = the sender's chunking, encoding and serializing before the first
byte (also in total_mean_ms). Payload = serialized protobuf bytes. The WAN's bandwidth follows
a seeded random trace (fluctuating every 100 ms) plus latency and jitter, so big transfers feel
bandwidth swings and queueing while a 1.5 KB message barely notices them.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import struct
import time

import numpy as np

from pddjax.errors import UserError
from pddjax.report import write_figures

CONTEXT = 256
KV_WIRE_DEFAULT = "native,bf16,int8,fp8"


def register(bsub) -> None:
    p = bsub.add_parser("handoff", help="token-ID handoff + extend-decode vs sending the tokens' KV over the WAN")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--kv-wire", default=KV_WIRE_DEFAULT,
                   help=f"comma list of KV wire formats for the KV paths (pddjax.kv.codec; default {KV_WIRE_DEFAULT})")
    p.add_argument("--wan-mbps", type=float, default=200.0, help="mean of the fluctuating bandwidth trace")
    p.add_argument("--wan-latency-ms", type=float, default=20.0)
    p.add_argument("--wan-jitter-ms", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures to this file")
    p.set_defaults(func=run)


def wire_formats(text: str) -> list[str]:
    """"native,int8" -> ["native", "int8"] (each a codec format, no repeats), or UserError."""
    from pddjax.kv import codec

    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise UserError(f"--kv-wire names no format: use a comma list of {', '.join(codec.FORMATS)}")
    for name in names:
        try:
            codec.parse(name)
        except codec.CodecError as e:
            raise UserError(f"--kv-wire: {e}") from None
    return list(dict.fromkeys(names))


def bandwidth_trace(mean_mbps: float, seed: int, seconds: float = 60.0,
                    step_s: float = 0.1) -> list[tuple[float, float]]:
    """Seeded lognormal swings around `mean_mbps` (sigma 0.6: a few x up and down)."""
    rng = random.Random(seed)
    mu = np.log(mean_mbps) - 0.18  # lognormal mean = exp(mu + sigma^2 / 2)
    return [(i * step_s, float(np.exp(rng.gauss(mu, 0.6)))) for i in range(int(seconds / step_s))]


async def _serve_frames(handler):
    """A TCP server (cluster B side) reading length-prefixed frames; handler(frames) -> None."""
    async def conn(r: asyncio.StreamReader, w: asyncio.StreamWriter):
        while True:
            try:
                n_frames = struct.unpack("<I", await r.readexactly(4))[0]
            except (asyncio.IncompleteReadError, asyncio.CancelledError, ConnectionError):
                break
            frames = []
            for _ in range(n_frames):
                size = struct.unpack("<I", await r.readexactly(4))[0]
                frames.append(await r.readexactly(size))
            handler(frames)
            w.write(b"k")
            await w.drain()
        w.close()

    srv = await asyncio.start_server(conn, "127.0.0.1", 0)
    return srv, f"127.0.0.1:{srv.sockets[0].getsockname()[1]}"


def _frame(frames: list[bytes]) -> bytes:
    return struct.pack("<I", len(frames)) + b"".join(struct.pack("<I", len(f)) + f for f in frames)


def summary(latency_ms: list[float], encode_ms: list[float], nbytes: int) -> dict:
    """One path's figures: payload bytes, latency (first byte -> MD ready) and the sender's encode."""
    return {"bytes": nbytes, "mean_ms": round(statistics.mean(latency_ms), 2), "max_ms": round(max(latency_ms), 2),
            "p50_ms": round(statistics.median(latency_ms), 2), "std_ms": round(statistics.pstdev(latency_ms), 2),
            "encode_ms": round(statistics.mean(encode_ms), 2),
            "total_mean_ms": round(statistics.mean(e + t for e, t in zip(encode_ms, latency_ms)), 2)}


def wire_table(per_format: dict) -> dict:
    """Each format's KV paths + its bytes against native's (when native was measured)."""
    native = per_format.get("native")
    out = {}
    for fmt, paths in per_format.items():
        row = dict(paths)
        if native:
            row["bytes_over_native"] = {k: round(paths[k]["bytes"] / native[k]["bytes"], 4) for k in paths}
        out[fmt] = row
    return out


def run(args) -> int:
    if args.tokens < 1 or args.trials < 1:
        raise UserError("--tokens and --trials must be at least 1")
    args.kv_formats = wire_formats(args.kv_wire)
    from pddjax.model.jax_setup import configure

    configure()
    return asyncio.run(_run(args))


async def _run(args) -> int:
    from pddjax.engines.paged_engine import EngineConfig, PagedEngine
    from pddjax.model.registry import ModelNotFound, load_model
    from pddjax.model.sampling_params import SamplingParams
    from pddjax.wan.emulator import WanEmulator
    from pddjax.wan.shaping import LinkProfile
    from serving import kvwire
    from serving.pb import cluster_pb2

    try:
        model = load_model(args.model)
    except ModelNotFound as e:
        raise UserError(str(e)) from None
    cfg, n, page = model.config, args.tokens, 16
    if CONTEXT + n + 2 > cfg.max_context:
        raise UserError(f"--tokens {n} does not fit the model context after a {CONTEXT}-token prompt")
    pages = 4 * (-(-(CONTEXT + n + 2) // page)) + 8
    ecfg = EngineConfig(dtype=args.dtype, page_size=page, num_pages=pages, max_step_tokens=512, max_rows=2)
    relay = PagedEngine(cfg, model.weights, model.fingerprint, ecfg)  # makes the tokens and their KV
    main = PagedEngine(cfg, model.weights, model.fingerprint, ecfg)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(3, cfg.vocab_size, CONTEXT).tolist()
    greedy = SamplingParams()

    relay.add("r", prompt, greedy, n + 2, ())
    while len(relay.seqs["r"].generated) < n + 1:
        relay.step()
    handed = relay.seqs["r"].generated[:n]  # the N tokens RLD generated (position 0 from P)
    kv_of = {"handoff_kv": relay.export_kv("r", CONTEXT, CONTEXT + n),  # their KV, as the KV path would send it
             "prompt_kv": relay.export_kv("r", 0, CONTEXT)}  # the prompt's KV: P -> MD before any handoff

    state: dict = {}

    def on_tokens(frames):
        msg = cluster_pb2.HandoffTokensRequest.FromString(frames[0])
        main.append_tokens(state["sid"], msg.start_position, list(msg.token_ids))
        main.step()  # one extend-decode pass over all N tokens -> MD's next token
        state["done"] = time.perf_counter()

    def on_kv(frames):
        asm = kvwire.Assembler(model.fingerprint, out_dtype=args.dtype)  # decoded into MD's pool dtype
        for f in frames:
            piece = asm.feed(cluster_pb2.KVChunk.FromString(f))
            if piece is not None:
                main.import_kv(state["sid"], piece)
        state["done"] = time.perf_counter()

    servers = {}
    for name, handler in (("token_ids", on_tokens), ("kv", on_kv)):
        srv, addr = await _serve_frames(handler)
        emu = WanEmulator(addr, LinkProfile(latency_ms=args.wan_latency_ms, jitter_ms=args.wan_jitter_ms,
                                            trace=bandwidth_trace(args.wan_mbps, args.seed), seed=args.seed))
        servers[name] = (srv, emu, await emu.start())

    def prepare(sid, path):
        main.add(sid, prompt, greedy, n + 2, ())
        if path == "prompt_kv":
            return  # MD holds the prompt's tokens, none of their KV
        main.import_kv(sid, kv_of["prompt_kv"])
        main.append_tokens(sid, 0, handed[:1] if path == "handoff_kv" else [])
        if path == "handoff_kv":  # the KV path also needs the tokens themselves (no KV computed for them)
            main.append_tokens(sid, 1, handed[1:])

    def frames_of(sid, path, fmt) -> list[bytes]:
        if path == "token_ids":
            msg = cluster_pb2.HandoffTokensRequest(request_id=sid, start_position=0, token_ids=handed, final=True)
            return [msg.SerializeToString()]
        run = kv_of[path]
        return [c.SerializeToString()
                for c in kvwire.chunks(sid, run, run.start, [], 1 << 20, kv_wire=fmt, page_tokens=page)]

    paths = [("token_ids", "")] + [(p, f) for f in args.kv_formats for p in ("handoff_kv", "prompt_kv")]
    latency: dict = {p: [] for p in paths}
    encode: dict = {p: [] for p in paths}
    payload: dict = {}
    warm = 2
    for trial in range(args.trials + warm):
        for path, fmt in paths:
            sid = f"{path}-{fmt}-{trial}"
            state["sid"] = sid
            prepare(sid, path)
            t_enc = time.perf_counter()
            frames = frames_of(sid, path, fmt)
            enc_ms = 1e3 * (time.perf_counter() - t_enc)
            payload[path, fmt] = sum(len(f) for f in frames)
            host, port = servers["token_ids" if path == "token_ids" else "kv"][2].split(":")
            r, w = await asyncio.open_connection(host, int(port))
            t0 = time.perf_counter()
            w.write(_frame(frames))
            await w.drain()
            await r.readexactly(1)
            if trial >= warm:
                latency[path, fmt].append(1e3 * (state["done"] - t0))
                encode[path, fmt].append(enc_ms)
            w.close()
            main.release(sid, cache=False)
        print(f"\rtrial {trial + 1}/{args.trials + warm}", end="", flush=True)
    print()
    for srv, emu, _ in servers.values():
        await emu.close()
        srv.close()

    def fig(path, fmt):
        return summary(latency[path, fmt], encode[path, fmt], payload[path, fmt])

    out = {"model": cfg.name, "dtype": args.dtype, "tokens": n, "prompt_tokens": CONTEXT, "trials": args.trials,
           "wan": {"mean_mbps": args.wan_mbps, "latency_ms": args.wan_latency_ms, "jitter_ms": args.wan_jitter_ms,
                   "trace": "lognormal sigma 0.6, 100 ms steps"},
           "token_ids": fig("token_ids", ""),
           "kv_wire": wire_table({f: {p: fig(p, f) for p in ("handoff_kv", "prompt_kv")} for f in args.kv_formats})}
    if "native" in args.kv_formats:  # the comparison this benchmark began with
        out["kv"] = out["kv_wire"]["native"]["handoff_kv"]
        out["payload_ratio"] = round(out["kv"]["bytes"] / out["token_ids"]["bytes"], 1)
    main.check_integrity()
    write_figures(out, args.json)
    return 0
