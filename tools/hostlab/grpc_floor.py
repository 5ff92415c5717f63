"""The floor of the serving path's per-token cost: bare grpc.aio CPU per streamed message on
this machine, both sides, for the messages the router sends (issue 18).

  .venv/bin/python -m tools.hostlab.grpc_floor [--streams 32 --tokens 64 --rounds 4
                                                --per-message 1,4,16 --engine-tokens-per-s 12000]

A server process answers one server-streaming call per stream; this process is the client (as
the bench client reading Generate). Modes, each with every --per-message k:
  - `generate`: GenerateResponse of k tokens (request_id, token_ids, sources, text) built and
    yielded as fast as the transport takes them: grpc.aio's own cost per message;
  - `fanout`: as the router does it: one producer task per "engine step" puts one item into each
    stream's asyncio.Queue, each stream's handler wakes, builds its GenerateResponse and yields
    it: grpc plus the per-request task wake-up the router cannot avoid either;
  - `step`: the internal hop (RLD / MD -> router, DecodeStream): one DecodeStreamResponse per
    step carrying every stream's RequestTokens of k tokens; the client walks the items;
  - `unary`: one unary call per "message" (a ReserveRequest-sized request, a small reply), every
    stream's calls concurrent: what each of a request's MatchPrefix / Reserve / Release /
    Handoff costs the router and the service (k is ignored: one row, at the first k).
CPU per message = the server process's CPU seconds (/proc) and this process's (process_time)
over the timed rounds / messages sent; build = constructing + serializing one message alone.
Given `--engine-tokens-per-s` (bench serving's `decode_tokens_per_s` at the same batch), it
prints how far the serving path can get on 2 cores with one user-facing message per token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import time

import grpc

from serving.engine.steplog import stat_cpu_s
from serving.pb import cluster_pb2, common_pb2, router_pb2

SERVICE, MODES = "floor.Floor", ("generate", "fanout", "step", "unary")


def generate_response(i: int, pos: int, k: int) -> router_pb2.GenerateResponse:
    return router_pb2.GenerateResponse(request_id=f"pdd-32-{i}", token_ids=range(pos, pos + k),
                                       sources=[common_pb2.ROLE_RELAY] * k, text=" tok" * k)


def step_response(streams: int, pos: int, k: int) -> cluster_pb2.DecodeStreamResponse:
    return cluster_pb2.DecodeStreamResponse(items=[cluster_pb2.RequestTokens(
        request_id=f"r{i:08x}", batch=cluster_pb2.TokenBatch(start_position=pos, token_ids=range(pos, pos + k)))
        for i in range(streams)])


# ---- the server (its own process) ------------------------------------------------------------
def _serve(port_q, streams: int, tokens: int) -> None:
    async def main():
        queues: dict[int, asyncio.Queue] = {}
        started = asyncio.Event()

        async def generate(req: bytes, ctx):  # req: b"k,i"
            k, i = map(int, req.decode().split(","))
            for pos in range(0, tokens, k):
                yield generate_response(i, pos, k)

        async def fanout(req: bytes, ctx):
            k, i = map(int, req.decode().split(","))
            q = queues[i] = asyncio.Queue()
            if len(queues) == streams:
                started.set()
            for _ in range(0, tokens, k):
                pos = await q.get()
                yield generate_response(i, pos, k)

        async def producer():
            while True:
                await started.wait()
                started.clear()
                k, step_s = int(os.environ.get("FLOOR_K", "1")), float(os.environ.get("FLOOR_STEP_MS", "2")) / 1e3
                qs = list(queues.values())
                queues.clear()
                for pos in range(0, tokens, k):
                    for q in qs:
                        q.put_nowait(pos)
                    await asyncio.sleep(step_s)  # one "engine step": every handler sleeps in between, as in the router

        async def step(req: bytes, ctx):
            k = int(req.decode().split(",")[0])
            for pos in range(0, tokens, k):
                yield step_response(streams, pos, k)

        async def unary(req: bytes, ctx):
            return cluster_pb2.ReserveResponse(cached_tokens=16)

        def handler(fn):
            return grpc.unary_stream_rpc_method_handler(fn, request_deserializer=bytes,
                                                        response_serializer=lambda m: m.SerializeToString())

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE, {"generate": handler(generate), "fanout": handler(fanout), "step": handler(step),
                      "unary": grpc.unary_unary_rpc_method_handler(
                          unary, request_deserializer=cluster_pb2.ReserveRequest.FromString,
                          response_serializer=lambda m: m.SerializeToString())}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        asyncio.get_running_loop().create_task(producer())
        port_q.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


# ---- the client (this process) ---------------------------------------------------------------
async def _client(port: int, mode: str, k: int, streams: int, tokens: int, rounds: int, server_pid: int) -> dict:
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    reply = cluster_pb2.DecodeStreamResponse if mode == "step" else router_pb2.GenerateResponse
    call = ch.unary_stream(f"/{SERVICE}/{mode}", request_serializer=bytes, response_deserializer=reply.FromString)
    unary = ch.unary_unary(f"/{SERVICE}/unary", request_serializer=lambda m: m.SerializeToString(),
                           response_deserializer=cluster_pb2.ReserveResponse.FromString)
    spec = cluster_pb2.SequenceSpec(request_id="0" * 32, prompt=range(32), max_tokens=64)

    async def one(i: int) -> int:
        got = 0
        if mode == "unary":
            for _ in range(0, tokens, k):
                got += (await unary(cluster_pb2.ReserveRequest(spec=spec, use_cache=True))).cached_tokens // 16 * k
            return got
        async for msg in call(f"{k},{i}".encode()):
            if mode == "step":
                for item in msg.items:
                    got += len(item.batch.token_ids)
            else:
                got += len(msg.token_ids)
        return got

    n_calls = 1 if mode == "step" else streams
    await asyncio.gather(*(one(i) for i in range(n_calls)))  # warm: connection, first calls
    s0, c0, t0 = stat_cpu_s(f"/proc/{server_pid}/stat")[1], time.process_time(), time.perf_counter()
    got = 0
    for _ in range(rounds):
        got += sum(await asyncio.gather(*(one(i) for i in range(n_calls))))
    wall, client_s = time.perf_counter() - t0, time.process_time() - c0
    server_s = stat_cpu_s(f"/proc/{server_pid}/stat")[1] - s0
    await ch.close()
    msgs = rounds * n_calls * (-(-tokens // k))
    assert got == rounds * streams * tokens, (got, rounds * streams * tokens)
    return {"mode": mode, "tokens_per_message": k, "messages": msgs, "wall_s": round(wall, 3),
            "server_us_per_message": round(1e6 * server_s / msgs, 1),
            "client_us_per_message": round(1e6 * client_s / msgs, 1),
            "server_us_per_token": round(1e6 * server_s / got, 1),
            "client_us_per_token": round(1e6 * client_s / got, 1)}


def build_us(k: int, n: int = 20000) -> float:
    """CPU us to construct and serialize one GenerateResponse of k tokens (no transport)."""
    t0 = time.process_time()
    for i in range(n):
        generate_response(i, i, k).SerializeToString()
    return round(1e6 * (time.process_time() - t0) / n, 2)


def run(args) -> dict:
    per_message = [int(x) for x in args.per_message.split(",")]
    ctx = mp.get_context("spawn")  # no forked gRPC state
    out = {"streams": args.streams, "tokens": args.tokens, "rounds": args.rounds, "load_1m": [], "rows": [],
           "build_us": {k: build_us(k) for k in per_message}}
    for k in per_message:
        os.environ["FLOOR_K"] = str(k)  # the fanout producer's step size and pace (read by the spawned server)
        os.environ["FLOOR_STEP_MS"] = str(args.step_ms)
        port_q = ctx.Queue()
        server = ctx.Process(target=_serve, args=(port_q, args.streams, args.tokens), daemon=True)
        server.start()
        try:
            port = port_q.get(timeout=60)
            for mode in MODES if k == per_message[0] else MODES[:-1]:
                out["rows"].append(asyncio.run(_client(port, mode, k, args.streams, args.tokens, args.rounds,
                                                       server.pid)))
                out["load_1m"].append(round(os.getloadavg()[0], 2))
        finally:
            server.terminate()
            server.join(10)
    out["floor"] = floor(out, args.engine_tokens_per_s)
    return out


def floor(out: dict, engine_tokens_per_s: float | None) -> dict:
    """Per token with one user-facing message per token: the fanout row at k = 1 (router side
    + client side) plus the internal hop's per-token share; against the engine on 2 cores."""
    rows = {(r["mode"], r["tokens_per_message"]): r for r in out["rows"]}
    user, hop = rows.get(("fanout", 1)), rows.get(("step", 1))
    if user is None or hop is None:
        return {}
    router_us = user["server_us_per_token"] + hop["client_us_per_token"]  # writes Generate, reads DecodeStream
    got = {"router_us_per_token": round(router_us, 1), "client_us_per_token": user["client_us_per_token"],
           "decoder_us_per_token": hop["server_us_per_token"],
           "outside_engine_us_per_token": round(router_us + user["client_us_per_token"]
                                                + hop["server_us_per_token"], 1)}
    if engine_tokens_per_s:
        engine_us = 1e6 / engine_tokens_per_s  # one core: wall = CPU
        # the decoder's core does its engine and its DecodeStream sends; the router and the client
        # share the other (P idle while decoding): the slower core bounds the stream
        core_decoder, core_other = engine_us + got["decoder_us_per_token"], router_us + got["client_us_per_token"]
        best = 1e6 / max(core_decoder, core_other)
        got.update({"engine_us_per_token": round(engine_us, 1), "decoder_core_us_per_token": round(core_decoder, 1),
                    "other_core_us_per_token": round(core_other, 1), "best_tokens_per_s": round(best),
                    "best_ratio": round(best / engine_tokens_per_s, 2)})
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--per-message", default="1,4,16", help="tokens per message (comma list)")
    ap.add_argument("--step-ms", type=float, default=2.0, help="fanout: the producer's 'engine step' interval")
    ap.add_argument("--engine-tokens-per-s", type=float, help="the engine alone's decode tokens/s at this batch")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    got = run(args)
    print(f"grpc.aio floor, {args.streams} streams x {args.tokens} tokens x {args.rounds} rounds "
          f"(load {got['load_1m']}); build+serialize us per GenerateResponse {got['build_us']}")
    print("| mode | tokens/msg | server us/msg | client us/msg | server us/token | client us/token | wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in got["rows"]:
        print(f"| {r['mode']} | {r['tokens_per_message']} | {r['server_us_per_message']} | "
              f"{r['client_us_per_message']} | {r['server_us_per_token']} | {r['client_us_per_token']} | "
              f"{r['wall_s']} |")
    print("floor per token:", json.dumps(got["floor"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(got, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
