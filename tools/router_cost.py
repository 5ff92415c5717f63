"""The router's CPU per output token on its own: N requests' streams through the real
`decode_streams.Subscription` and `stream.Output`, no gRPC and no engine.

Each engine step is one DecodeStream message: a RequestTokens per request (one token each)
delivered to the requests' subscriptions in one event-loop pass, as `decode_streams.Mux._read`
does; each request's messages are read through three nested async generators, as the Generate
handler reads them (`Generate` -> `_answered` -> `_generate` -> `Output.messages`). CPU time of
the whole loop (process time) over the tokens, per stream interval; rounds interleave the
intervals and the figures are the medians and minima over rounds. What it leaves out: the
DecodeStream's parse, the user's stream writes (gRPC), admission and the tiers' calls.

  .venv/bin/python -m tools.router_cost [--requests 64 --tokens 256 --intervals 1,8 --rounds 7] [--json F]

Another revision: run it from that revision's checkout (`git worktree add D REV`, then
`PYTHONPATH=D python -m tools.router_cost` from D) in turns with this tree's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from serving.pb import cluster_pb2, common_pb2
from serving.router.decode_streams import Subscription
from serving.router.metrics import RouterMetrics
from serving.router.request import Request
from serving.router.request_state import State
from serving.router.stream import Output


class _Mux:
    """What a Subscription asks of its DecodeStream: to forget it once the service ended it."""

    def forget(self, sub) -> None:
        pass


async def _nested(gen):
    async for msg in gen:
        yield msg


async def _read(out: Output) -> int:
    n = 0
    async for _ in _nested(_nested(out.messages())):
        n += 1
    return n


async def one_run(requests: int, tokens: int, interval: int, metrics: RouterMetrics) -> tuple[float, int]:
    """-> (CPU us per output token, messages sent) for `requests` streams of `tokens` tokens."""
    subs, reads = [], []
    for i in range(requests):
        r = Request(rid=f"r{i}", label=f"r{i}")
        r.pipeline, r.stream_interval = common_pb2.PIPELINE_PD_LOCAL, (interval, 0.0)
        for s in (State.ADMISSION, State.PLAN, State.RESERVE, State.RELAY_STREAMING):
            r.advance(s)
        subs.append(Subscription(_Mux(), r.rid, r.relay_out, "relay"))
        reads.append(asyncio.create_task(_read(Output(r, None, (), metrics))))
    await asyncio.sleep(0)
    c0 = time.process_time()
    for pos in range(tokens):
        finish = common_pb2.FINISH_REASON_LENGTH if pos == tokens - 1 else 0
        msg = cluster_pb2.DecodeStreamResponse(items=[
            cluster_pb2.RequestTokens(request_id=s.rid, batch=cluster_pb2.TokenBatch(
                start_position=pos, token_ids=[7 + pos % 100], finish_reason=finish)) for s in subs])
        for sub, item in zip(subs, msg.items):
            sub.deliver(item)
        await asyncio.sleep(0)  # the next step's message comes in a later loop pass
    sent = sum(await asyncio.gather(*reads))
    return 1e6 * (time.process_time() - c0) / (requests * tokens), sent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--intervals", default="1,8", help="tokens per message, comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    intervals = [int(x) for x in a.intervals.split(",")]
    metrics = RouterMetrics()
    got: dict[int, list[float]] = {k: [] for k in intervals}
    messages: dict[int, int] = {}
    for _ in range(a.rounds):
        for k in intervals:
            us, messages[k] = asyncio.run(one_run(a.requests, a.tokens, k, metrics))
            got[k].append(us)
    rows = [{"interval": k, "us_per_token_p50": round(statistics.median(v), 2), "us_per_token_min": round(min(v), 2),
             "messages_per_request": messages[k] / a.requests, "rounds": [round(x, 2) for x in v]}
            for k, v in got.items()]
    print(f"router CPU per output token ({a.requests} streams x {a.tokens} tokens, {a.rounds} rounds):")
    for row in rows:
        print(f"  interval {row['interval']}: p50 {row['us_per_token_p50']} us, min {row['us_per_token_min']} us, "
              f"{row['messages_per_request']:.1f} messages a request")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"requests": a.requests, "tokens": a.tokens, "intervals": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
