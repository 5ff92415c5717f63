"""Stream intervals in the router (serving/router/interval.py): a request's interval only coarser
than the service's, bad values refused naming the field; the real `stream.Output` on a real
`Request` groups K tokens a message (the first tokens and the final message at once, the same
text joined), no token waits past `stream_interval_ms` behind a slow engine; tool-call deltas and
logprobs joined without loss or duplicates."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from serving.config import RouterSettings
from serving.pb import cluster_pb2, common_pb2, router_pb2
from serving.router.interval import Delta, Group, chosen, join
from serving.router.metrics import RouterMetrics
from serving.router.request import Abort, Request
from serving.router.request_state import State
from serving.router.stream import Output

TEXT = "stream intervals group tokens, never lose one: ok " * 3


class ByteTokenizer:
    def decode(self, ids, skip_special: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def run(data: bytes, interval=(1, 0.0), every_s: float = 0.0, at_source: bool = False):
    """-> [(message, perf_counter received)], [perf_counter each token was put] for one-token RLD
    batches (`every_s` apart: a slow engine) through Output at `interval` (`at_source`: RLD holds
    the tokens to it, `Request.interval_at_source`)."""

    async def main():
        r = Request()
        r.pipeline, r.stream_interval, r.interval_at_source = common_pb2.PIPELINE_PD_LOCAL, interval, at_source
        for state in (State.ADMISSION, State.PLAN, State.RESERVE, State.RELAY_STREAMING):
            r.advance(state)
        put_at = []

        async def relay():
            for i, b in enumerate(data):
                last = i == len(data) - 1
                put_at.append(time.perf_counter())
                r.relay_out.put_nowait(cluster_pb2.TokenBatch(
                    start_position=i, token_ids=[b],
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED))
                await asyncio.sleep(every_s)

        feeder = asyncio.create_task(relay())
        got = [(m, time.perf_counter()) async for m in Output(r, ByteTokenizer(), (), RouterMetrics()).messages()]
        feeder.cancel()
        return got, put_at

    return asyncio.run(main())


def req(**kw) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(**kw)


def test_a_request_may_only_ask_coarser():
    assert chosen(1, 0.0, req()) == (1, 0.0)
    assert chosen(4, 20.0, req()) == (4, 20.0)  # unset: the service's
    assert chosen(4, 20.0, req(stream_interval=8, stream_interval_ms=50)) == (8, 50.0)
    assert chosen(4, 20.0, req(stream_interval=2, stream_interval_ms=5)) == (4, 20.0)  # finer: raised
    assert chosen(4, 20.0, req(stream_interval_ms=0)) == (4, 0.0)  # no time bound is the coarsest
    assert chosen(4, 0.0, req(stream_interval_ms=50)) == (4, 0.0)


@pytest.mark.parametrize("kw,field", [({"stream_interval": 0}, "stream_interval"),
                                      ({"stream_interval": 1025}, "stream_interval"),
                                      ({"stream_interval_ms": 60_001}, "stream_interval_ms")])
def test_out_of_range_is_invalid_argument_naming_the_field(kw, field):
    with pytest.raises(Abort) as e:
        chosen(1, 0.0, req(**kw))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.message.startswith(field + " must")


@pytest.mark.parametrize("kw", [{"stream_interval": 0}, {"stream_interval_ms": -1}, {"stream_interval": 2000},
                                {"interval_at_source": "yes"}])
def test_service_settings_out_of_range_are_refused(kw):
    from pddjax.errors import UserError

    with pytest.raises(UserError, match=next(iter(kw))):
        RouterSettings(**kw)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_k_tokens_a_message_first_and_final_at_once(k):
    data = TEXT.encode()
    got, _ = run(data, (k, 0.0))
    msgs = [m for m, _ in got]
    assert b"".join(bytes(m.token_ids) for m in msgs) == data
    assert "".join(m.text for m in msgs) == TEXT
    assert all(len(m.sources) == len(m.token_ids) for m in msgs)
    assert len(msgs[0].token_ids) == 1  # the first token goes alone, at once
    assert all(len(m.token_ids) == k for m in msgs[1:-1])  # every middle message holds exactly K
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == len(data) and not any(m.finish_reason for m in msgs[:-1])
    assert len(msgs) <= 2 + (len(data) - 1) // k


@pytest.mark.parametrize("k", [1, 8])
def test_the_requests_task_wakes_once_a_message_not_once_a_batch(k, monkeypatch):
    """One-token batches, each in a loop pass of its own (as RLD's steps bring them): they are
    read where they arrive, and the request's task waits only for whole messages."""
    waits = []
    wait = Output._wait

    async def counted(self):
        waits.append(1)
        return await wait(self)

    monkeypatch.setattr(Output, "_wait", counted)
    data = TEXT.encode()
    got, _ = run(data, (k, 0.0))
    assert b"".join(bytes(m.token_ids) for m, _ in got) == data
    assert len(got) <= 2 + (len(data) - 1) // k
    assert len(waits) <= len(got) + 1  # at K = 8: ~20 waits for 153 batches (one per batch before)


def test_no_token_waits_past_the_bound_behind_a_slow_engine():
    """One token every 15 ms, 8 a message: without a bound tokens wait ~100 ms; with 40 ms none
    waits past it (plus the loop's slack), and messages hold about 3 tokens."""
    data = TEXT.encode()[:40]
    unbounded, _ = run(data, (8, 0.0), every_s=0.015)
    assert max(len(m.token_ids) for m, _ in unbounded) == 8
    got, put_at = run(data, (8, 40.0), every_s=0.015)
    waits, pos = [], 0
    for m, at in got:
        if m.token_ids:
            waits.append(at - put_at[pos])  # the oldest token of the message
            pos += len(m.token_ids)
    assert pos == len(data) and bytes(t for m, _ in got for t in m.token_ids) == data
    print(f"longest wait {max(waits) * 1e3:.1f} ms, tokens per message {len(data) / len(waits):.1f}")
    assert max(waits) < 0.040 + 0.025
    assert max(len(m.token_ids) for m, _ in got) < 8


def test_where_rld_holds_to_a_bound_the_router_sends_each_batch_as_it_comes():
    """RLD holds the tokens (StreamHold): a batch short of K with a bound waited it there already,
    so the router adds no wait of its own; without a bound it still joins short batches to K
    (the switch's, in pdd)."""
    data = TEXT.encode()[:30]
    got, _ = run(data, (8, 40.0), at_source=True)
    assert [len(m.token_ids) for m, _ in got] == [1] * len(data)
    got, _ = run(data, (8, 0.0), at_source=True)
    assert [len(m.token_ids) for m, _ in got] == [1, 8, 8, 8, 5]


def test_join_merges_a_calls_deltas_and_keeps_logprobs_in_order():
    a = Delta([1], [1], "x", [common_pb2.TokenLogprob(logprob=-0.1)],
              [router_pb2.ToolCallDelta(index=0, id="c0", name="f", arguments='{"a"')])
    b = Delta([2, 3], [1, 1], "yz", [common_pb2.TokenLogprob(logprob=x) for x in (-0.2, -0.3)],
              [router_pb2.ToolCallDelta(index=0, arguments=": 1}"),
               router_pb2.ToolCallDelta(index=1, id="c1", name="g", arguments="{}")],
              finish_reason=common_pb2.FINISH_REASON_STOP)
    join(a, b)
    assert a.token_ids == [1, 2, 3] and "".join(a.text) == "xyz" and len(a.sources) == 3
    assert [round(lp.logprob, 2) for lp in a.logprobs] == [-0.1, -0.2, -0.3]
    assert [(d.index, d.id, d.name, d.arguments) for d in a.tool_calls] == [(0, "c0", "f", '{"a": 1}'),
                                                                             (1, "c1", "g", "{}")]
    assert a.finish_reason == common_pb2.FINISH_REASON_STOP


def test_group_passes_messages_through_at_one_token():
    g = Group(1, 0.0)
    d = Delta([5], [1])
    assert g.add(d) is d and g.add(d) is d and g.held is None
