"""The router's CPU per output token on its own: N requests' streams through the real
`decode_streams.Subscription` and `stream.Output`, no gRPC and no engine.

Each engine step is one DecodeStream message: a RequestTokens per request (one token each)
delivered to the requests' subscriptions in one event-loop pass, as `decode_streams.Mux._read`
does; each request's messages are read through three nested async generators, as the Generate
handler reads them (`Generate` -> `_answered` -> `_generate` -> `Output.messages`). CPU time of
the whole loop (process time) over the tokens, per stream interval; rounds interleave the
intervals and the figures are the medians and minima over rounds. What it leaves out: the
DecodeStream's parse, the user's stream writes (gRPC), admission and the tiers' calls.

`--at-source`: beside each interval K > 1, the same streams as RLD sends them when it holds the
tokens to K (`[router] interval_at_source`, StreamHold): the first token alone, then one entry of
K tokens every K steps, instead of one token every step.

  .venv/bin/python -m tools.router_cost [--requests 64 --tokens 256 --intervals 1,8 --rounds 7] [--at-source] [--json F]

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


async def one_run(requests: int, tokens: int, interval: int, metrics: RouterMetrics,
                  at_source: bool = False) -> tuple[float, int]:
    """-> (CPU us per output token, messages sent) for `requests` streams of `tokens` tokens
    (`at_source`: RLD's entries hold `interval` tokens each after the first)."""
    subs, reads = [], []
    for i in range(requests):
        r = Request(rid=f"r{i}", label=f"r{i}")
        r.pipeline, r.stream_interval = common_pb2.PIPELINE_PD_LOCAL, (interval, 0.0)
        r.interval_at_source = at_source
        for s in (State.ADMISSION, State.PLAN, State.RESERVE, State.RELAY_STREAMING):
            r.advance(s)
        subs.append(Subscription(_Mux(), r.rid, r.relay_out, "relay"))
        reads.append(asyncio.create_task(_read(Output(r, None, (), metrics))))
    await asyncio.sleep(0)
    c0 = time.process_time()
    pos = 0
    while pos < tokens:
        n = min(interval, tokens - pos) if at_source and pos else 1
        finish = common_pb2.FINISH_REASON_LENGTH if pos + n == tokens else 0
        msg = cluster_pb2.DecodeStreamResponse(items=[
            cluster_pb2.RequestTokens(request_id=s.rid, batch=cluster_pb2.TokenBatch(
                start_position=pos, token_ids=[7 + (pos + j) % 100 for j in range(n)], finish_reason=finish))
            for s in subs])
        for sub, item in zip(subs, msg.items):
            sub.deliver(item)
        await asyncio.sleep(0)  # the next message comes in a later loop pass
        pos += n
    sent = sum(await asyncio.gather(*reads))
    return 1e6 * (time.process_time() - c0) / (requests * tokens), sent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--intervals", default="1,8", help="tokens per message, comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--at-source", action="store_true", help="also each K > 1 as RLD sends it when it holds to K")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    cases = [(int(x), False) for x in a.intervals.split(",")]
    cases += [(k, True) for k, _ in cases if a.at_source and k > 1]
    metrics = RouterMetrics()
    got: dict[tuple[int, bool], list[float]] = {c: [] for c in cases}
    messages: dict[tuple[int, bool], int] = {}
    for _ in range(a.rounds):
        for k, at_source in cases:
            us, messages[k, at_source] = asyncio.run(one_run(a.requests, a.tokens, k, metrics, at_source))
            got[k, at_source].append(us)
    rows = [{"interval": k, "at_source": s, "us_per_token_p50": round(statistics.median(v), 2),
             "us_per_token_min": round(min(v), 2), "messages_per_request": messages[k, s] / a.requests,
             "rounds": [round(x, 2) for x in v]} for (k, s), v in got.items()]
    print(f"router CPU per output token ({a.requests} streams x {a.tokens} tokens, {a.rounds} rounds):")
    for row in rows:
        print(f"  interval {row['interval']}{' held at the source' if row['at_source'] else ''}: "
              f"p50 {row['us_per_token_p50']} us, min {row['us_per_token_min']} us, "
              f"{row['messages_per_request']:.1f} messages a request")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"requests": a.requests, "tokens": a.tokens, "intervals": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
