"""What the OpenAI gateway adds: N concurrent streams straight to the router's gRPC Generate,
and the same through the gateway (streamed completions with token-id prompts), on one `pddjax
up` stack of the tiny model; TTFT p50 and ITL p50 of each side and their ratio (issue 21's
target: the gateway adds at most 10%).

  python -m tools.hostlab.openai_overhead [--streams 64] [--rounds 2] [--json F] [--state F]

A load benchmark, not a test: it prints figures. One client process measures both sides, each
the way its clients would run: direct = one grpc.aio channel with the N streams on it; gateway
= N HTTP/1.1 keep-alive connections from one aiohttp session (`connections`), opened by the
warm-up round, so neither side pays a connection setup in a timed round (the gateway side's
count of new connections per round is printed: 0 means none). Rounds alternate direct /
gateway so drift (other work on the machine) hits both; every run has prompts of its own (no
prefix-cache help for whichever goes second); the warm-up round sends the same prompts both
ways first and checks the tokens are identical. TTFT = request sent (before the client's
call) -> first token-carrying message parsed; ITL = gaps between token-carrying messages, a
message of k tokens counting k gaps of gap/k (as `bench serve`); TPOT = a stream's mean gap
(chunks that reach the client together make near-zero ITL gaps). Both include the client's
own parse (protobuf vs JSON) and, via the gateway, everything the gateway does plus its hop.
Also per round (from /proc): the router process's CPU seconds in each side's round, the
gateway's when it is its own process (`pddjax up` co-hosts it in the router's: then the
router's CPU in a gateway round is both's, and the difference to a direct round is what the
gateway costs), and this process's CPU per side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

STACK = {"model": "tiny", "platform": "cpu", "wan": {"mbps": 0, "latency_ms": 0}, "router": {"chunk_bytes": 4096},
         "engine": {"dtype": "float32", "page_size": 16, "num_pages": 1024, "max_step_tokens": 256, "max_rows": 64}}


def start_stack(workdir: str, timeout: float = 1200.0) -> tuple[subprocess.Popen, dict]:
    cfg, state = os.path.join(workdir, "stack.json"), os.path.join(workdir, "state.json")
    with open(cfg, "w") as f:
        json.dump(STACK, f)
    proc = subprocess.Popen([sys.executable, "-m", "serving", "up", "--config", cfg, "--port", "0", "--state", state],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while not os.path.exists(state):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("pddjax up did not start")
        time.sleep(0.2)
    with open(state) as f:
        return proc, json.load(f)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, length).tolist() for _ in range(n)]


class Timed:
    """One stream's token times."""

    def __init__(self):
        self.t0, self.last, self.ttft, self.gaps, self.tokens = time.perf_counter(), None, None, [], []
        self.router_ttft = None  # s: the router's own TTFT (its request received -> first token sent)
        self.gateway_ttft = None  # s: the gateway's own (its request received -> first token sent on)

    def got(self, ids) -> None:
        if not ids:
            return
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.t0
        else:
            self.gaps += [(now - self.last) / len(ids)] * len(ids)
        self.last = now
        self.tokens += ids


async def direct(stub, ps, max_tokens: int, pipeline: str) -> list[Timed]:
    from serving.client import make_request

    async def one(p):
        t = Timed()
        async for msg in stub.Generate(make_request(p, max_tokens=max_tokens, pipeline=pipeline, ignore_eos=True),
                                       timeout=600):
            t.got(list(msg.token_ids))
            if msg.finish_reason:
                t.router_ttft = msg.timings.ttft_ms / 1e3
        return t

    return await asyncio.gather(*(one(p) for p in ps))


async def gateway(session, url: str, ps, max_tokens: int, pipeline: str, model: str = "tiny") -> list[Timed]:
    """Streamed completions over plain aiohttp (one JSON parse per event, like protobuf's one
    parse per message on the direct side): the official `openai` client's per-chunk pydantic
    models would put the client's own cost into the gateway's figures (tests/serving/openai/test_api.py
    uses it). See `connections` for why aiohttp and not httpx."""

    async def one(p):
        t = Timed()
        body = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True, "pipeline": pipeline}
        async with session.post(url + "/completions", json=body) as r:
            r.raise_for_status()
            async for raw in r.content:  # one line at a time
                line = raw.rstrip(b"\r\n")
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunk = json.loads(line[6:])
                    t.got(chunk["choices"][0].get("token_ids") if chunk.get("choices") else None)
                    if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                        t.router_ttft = chunk["pddjax"]["router_ttft_ms"] / 1e3
                        t.gateway_ttft = chunk["pddjax"]["gateway_ttft_ms"] / 1e3
        return t

    return await asyncio.gather(*(one(p) for p in ps))


@contextlib.asynccontextmanager
async def connections(n: int, api_key: str | None = None):
    """-> (an aiohttp session that holds up to n keep-alive connections, a counter of the TCP
    connections it opened). The warm-up round opens them, so a timed round reuses them as n
    agents' clients would (the counter shows whether it had to open any).

    Why not httpx: httpcore 1.0's pool hands a burst of concurrent requests the same idle
    connection, and all but one then retry (ConnectionNotAvailable) one after another, so 64
    requests left this process over ~1-3 s, which counted as TTFT (issue 21's first figures:
    the send -> socket write wait was 0.8-1.7 s p50). One httpx client per stream fixes that but
    httpx's per-chunk cost (anyio, httpcore, h11) was then ~0.35-0.45 s of this process's CPU per
    round against gRPC's ~0.2-0.3: on a 2-core machine the client's own CPU slowed the stack
    under the gateway side only. aiohttp's C parser costs ~0.15-0.2 s, as much as the gRPC side."""
    import aiohttp

    opened = {"tcp": 0}

    async def counted(session, ctx, params) -> None:
        opened["tcp"] += 1

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_start.append(counted)
    # idle connections close on this side first (the gateway keeps them 75 s: server.KEEPALIVE_S),
    # so a timed round never reuses one the server is closing
    connector = aiohttp.TCPConnector(limit=n, limit_per_host=n, keepalive_timeout=60)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(connector=connector, trace_configs=[trace], headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        yield session, opened


async def measure(router: str, url: str, pids: tuple[int, int], n: int, L: int, m: int, rounds: int, pipeline: str):
    """-> ({"direct": [runs], "gateway": [runs]}, costs per round: the router process's CPU s in
    each side's round, the gateway process's (when it is its own process), this client's CPU s
    per side and the TCP connections the gateway side opened). `pids`: (router, gateway); the
    same pid when the gateway is co-hosted (the router's CPU in a gateway round is then both's).
    One gRPC channel (n streams on it, as a gRPC client does) and n HTTP/1.1 connections (one per
    stream, as n HTTP clients would hold; opened by the warm-up round) for the whole measurement."""
    import grpc

    from serving.pb import router_pb2_grpc

    async with grpc.aio.insecure_channel(router) as ch, connections(n) as (session, opened):
        stub = router_pb2_grpc.RouterStub(ch)
        warm = prompts(n, L, 0)
        a, b = await direct(stub, warm, m, pipeline), await gateway(session, url, warm, m, pipeline)
        assert [t.tokens for t in a] == [t.tokens for t in b], "the gateway's tokens differ from the router's"
        side: dict[str, list] = {"direct": [], "gateway": []}
        costs: dict[str, list] = {"router_cpu_s_direct": [], "router_cpu_s_gateway": [], "gateway_cpu_s": [],
                                  "client_cpu_s_direct": [], "client_cpu_s_gateway": [], "new_connections": []}
        router_pid, gw_pid = pids
        for r in range(rounds):
            c0, r0 = time.process_time(), cpu_s(router_pid)
            side["direct"].append(await direct(stub, prompts(n, L, 1 + 2 * r), m, pipeline))
            c1, r1, g0, tcp0 = time.process_time(), cpu_s(router_pid), cpu_s(gw_pid), opened["tcp"]
            side["gateway"].append(await gateway(session, url, prompts(n, L, 2 + 2 * r), m, pipeline))
            r2 = cpu_s(router_pid)
            costs["router_cpu_s_direct"].append(round(r1 - r0, 2))
            costs["router_cpu_s_gateway"].append(round(r2 - r1, 2))
            costs["gateway_cpu_s"].append(round(cpu_s(gw_pid) - g0, 2) if gw_pid != router_pid else None)
            costs["client_cpu_s_direct"].append(round(c1 - c0, 2))
            costs["client_cpu_s_gateway"].append(round(time.process_time() - c1, 2))
            costs["new_connections"].append(opened["tcp"] - tcp0)
    return side, costs


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def figures(runs: list[list[Timed]]) -> dict:
    ttft = [t.ttft for run in runs for t in run]
    gaps = [g for run in runs for t in run for g in t.gaps]
    tpot = [sum(t.gaps) / len(t.gaps) for run in runs for t in run if t.gaps]  # per stream: no burst artefacts
    outside = [t.ttft - t.router_ttft for run in runs for t in run]  # client, hops (and gateway): not the router's
    return {"ttft_p50_ms": round(1e3 * statistics.median(ttft), 2),
            "tpot_p50_ms": round(1e3 * statistics.median(tpot), 2),
            "itl_p50_ms": round(1e3 * statistics.median(gaps), 2),
            "router_ttft_p50_ms": round(1e3 * statistics.median([t.router_ttft for run in runs for t in run]), 2),
            "outside_router_ttft_p50_ms": round(1e3 * statistics.median(outside), 2),
            "ttft_p90_ms": round(1e3 * float(np.percentile(ttft, 90)), 2),
            "itl_p90_ms": round(1e3 * float(np.percentile(gaps, 90)), 2), "streams": len(ttft), "gaps": len(gaps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds per side (alternating)")
    ap.add_argument("--pipeline", default="pd-cross")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--state", help="use this running `pddjax up` (its state file; tiny model, no token) instead")
    args = ap.parse_args(argv)
    if args.state:
        proc = None
        with open(args.state) as f:
            state = json.load(f)
    else:
        print("starting a tiny stack (pddjax up) ...", file=sys.stderr, flush=True)
        proc, state = start_stack(tempfile.mkdtemp(prefix="pddjax-openai-overhead-"))
    try:
        router, url, gw_pid = state["router"], state["openai"], state["openai_service"]["pid"]
        router_pid = next(s["pid"] for s in state["services"] if s["role"] == "router")
        n, L, m = args.streams, args.prompt_tokens, args.max_tokens
        side, costs = asyncio.run(measure(router, url, (router_pid, gw_pid), n, L, m, args.rounds, args.pipeline))
        d, g = figures(side["direct"]), figures(side["gateway"])
        inside = [t.gateway_ttft - t.router_ttft for run in side["gateway"] for t in run]
        g["gateway_own_ttft_p50_ms"] = round(1e3 * statistics.median(inside), 2)  # its TTFT less the router's
        out = {"streams": n, "prompt_tokens": L, "max_tokens": m, "rounds": args.rounds, "pipeline": args.pipeline,
               "direct": d, "gateway": g, "per_round": costs,
               "ttft_p50_ratio": round(g["ttft_p50_ms"] / d["ttft_p50_ms"], 3),
               "itl_p50_ratio": round(g["itl_p50_ms"] / d["itl_p50_ms"], 3),
               "tpot_p50_ratio": round(g["tpot_p50_ms"] / d["tpot_p50_ms"], 3), "loadavg": os.getloadavg(),
               "cohosted": gw_pid == router_pid}
        where = ("co-hosted: in the router's process, counted in its CPU" if out["cohosted"]
                 else f"its own process: {costs['gateway_cpu_s']} s")
        print(f"{n} streams x {m} tokens ({args.pipeline}, {args.rounds} rounds each):\n"
              f"  direct gRPC : TTFT p50 {d['ttft_p50_ms']} ms, ITL p50 {d['itl_p50_ms']} ms, TPOT p50 "
              f"{d['tpot_p50_ms']} ms\n"
              f"  via gateway : TTFT p50 {g['ttft_p50_ms']} ms, ITL p50 {g['itl_p50_ms']} ms, TPOT p50 "
              f"{g['tpot_p50_ms']} ms\n"
              f"  per round   : router process CPU direct {costs['router_cpu_s_direct']} s, via gateway "
              f"{costs['router_cpu_s_gateway']} s; the gateway ({where}); this client's CPU direct "
              f"{costs['client_cpu_s_direct']} s, via gateway {costs['client_cpu_s_gateway']} s; new HTTP "
              f"connections {costs['new_connections']}\n"
              f"  ratio       : TTFT {out['ttft_p50_ratio']}, ITL {out['itl_p50_ratio']}, TPOT {out['tpot_p50_ratio']} "
              f"(target <= 1.10; load average {out['loadavg'][0]:.1f})\n"
              f"  TTFT outside the router (client TTFT - the router's own), p50: direct "
              f"{d['outside_router_ttft_p50_ms']} ms, via gateway {g['outside_router_ttft_p50_ms']} ms; "
              f"the router's own TTFT p50: {d['router_ttft_p50_ms']} / {g['router_ttft_p50_ms']} ms; the gateway's "
              f"own TTFT less the router's, p50: {g['gateway_own_ttft_p50_ms']} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    raise SystemExit(main())
