"""The router's per-request object and its output stream, without any service: holding and
releasing instances, what a request touched, `check_integrity` catching corrupted states, and
`stream.Output` merging RLD's and MD's batches (handoff, order check, usage)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from serving.pb import cluster_pb2, common_pb2
from serving.router.metrics import RouterMetrics
from serving.router.pools import Instance
from serving.router.request import Abort, Request
from serving.router.stream import Output


def pdd_request() -> Request:
    r = Request(rid="r1", prompt=[5, 6, 7], pipeline=common_pb2.PIPELINE_PDD, stage="reserve")
    r.prefill, r.relay = Instance("prefill", "p:1"), Instance("relay", "r:1")
    r.main_choice = Instance("main", "m:1")
    return r


def test_hold_counts_each_instance_once_and_unhold_is_idempotent():
    r = pdd_request()
    r.hold(r.prefill)
    r.hold(r.relay)
    r.hold(r.relay)
    assert (r.prefill.inflight, r.relay.inflight) == (1, 1)
    r.check_integrity()
    r.unhold()
    r.unhold()
    assert (r.prefill.inflight, r.relay.inflight) == (0, 0)
    r.hold(r.prefill)  # settled: a late replacement P is not loaded by this request
    assert r.prefill.inflight == 0 and not r.held
    r.check_integrity()


def test_touched_lists_every_instance_once():
    r = pdd_request()
    full, fallback = r.main_choice, Instance("main", "m:2")
    r.main_asked = [full, fallback]
    r.main = fallback
    extra = Instance("prefill", "p:2")
    r.prefill_extra = [extra]
    assert r.touched() == [r.prefill, r.relay, fallback, full, extra]
    r.pipeline, r.main = common_pb2.PIPELINE_PD_CROSS, None  # no relay tier; MDs asked are still released
    assert r.touched() == [r.prefill, full, fallback, extra]


@pytest.mark.parametrize("corrupt", [
    lambda r: r.held.extend([r.prefill, r.prefill]),
    lambda r: setattr(r, "finished", True),
    lambda r: setattr(r, "main", Instance("main", "never-asked")),
    lambda r: setattr(r, "stage", "stream"),  # pdd streaming without a reserved MD
    lambda r: setattr(r, "relay_lost", True),
    lambda r: setattr(r, "main_kv_ok", True),
    lambda r: r.tokens.append(1),
])
def test_check_integrity_catches_corruption(corrupt):
    r = pdd_request()
    r.check_integrity()
    corrupt(r)
    with pytest.raises(AssertionError):
        r.check_integrity()


def batch(start, ids, **kw):
    return cluster_pb2.TokenBatch(start_position=start, token_ids=ids, **kw)


async def collect(r: Request) -> list:
    return [m async for m in Output(r, None, [], RouterMetrics()).messages()]


def test_output_switches_to_main_at_the_handoff():
    async def run():
        r = pdd_request()
        r.relay_out.put_nowait(batch(0, [1, 2]))
        r.relay_out.put_nowait(batch(2, [3], handed_off=True, handed_off_at=3))
        r.main_out.put_nowait(batch(3, [4, 5], finish_reason=common_pb2.FINISH_REASON_LENGTH))
        return r, await collect(r)

    r, msgs = asyncio.run(run())
    assert [list(m.token_ids) for m in msgs] == [[1, 2, 3], [4, 5]]
    assert r.tokens == [1, 2, 3, 4, 5] and r.handoff_at == 3
    last = msgs[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (last.usage.relay_tokens, last.usage.main_tokens, last.timings.handoff_position) == (3, 2, 3)
    r.main = r.main_choice
    r.main_asked = [r.main]
    r.stage = "stream"
    r.check_integrity()


def test_output_refuses_a_gap_and_raises_an_abort():
    async def run(item):
        r = pdd_request()
        r.relay_out.put_nowait(batch(0, [1]))
        r.relay_out.put_nowait(item)
        return await collect(r)

    with pytest.raises(Abort) as e:
        asyncio.run(run(batch(2, [3])))
    assert e.value.code == grpc.StatusCode.INTERNAL
    with pytest.raises(Abort) as e:
        asyncio.run(run(Abort(grpc.StatusCode.UNAVAILABLE, "gone", "relay")))
    assert e.value.stage == "relay"


def test_output_moves_to_main_once_it_caught_up_while_relay_streams_on():
    """Chunked handoff: RLD streams on after its final (at 3); MD's batches from 3 are held and
    checked; the stream moves to MD when MD holds the user's next position (here 5), RLD is
    released (on_switch) and its later batches are dropped; MD's overlap is not sent twice."""
    switched = []

    async def run():
        r = pdd_request()
        r.relay_out.put_nowait(batch(0, [1, 2, 3]))
        r.main_out.put_nowait(batch(3, [4]))  # MD emits from its final (3): behind the user
        r.relay_out.put_nowait(batch(3, [4]))
        r.relay_out.put_nowait(batch(4, [5]))
        r.main_out.put_nowait(batch(4, [5, 6]))  # MD caught up: it holds position 5
        r.relay_out.put_nowait(batch(5, [6]))  # RLD, still decoding: dropped after the switch
        r.main_out.put_nowait(batch(6, [7], finish_reason=common_pb2.FINISH_REASON_LENGTH))
        msgs = [m async for m in Output(r, None, [], RouterMetrics(), lambda: switched.append(1)).messages()]
        return r, msgs

    r, msgs = asyncio.run(run())
    assert r.tokens == [1, 2, 3, 4, 5, 6, 7] and switched == [1]
    assert r.sources == [common_pb2.ROLE_RELAY] * r.handoff_at + [common_pb2.ROLE_MAIN] * (7 - r.handoff_at)
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_output_stays_on_relay_when_main_disagrees():
    """A heterogeneous pair whose tokens differ after the final: RLD keeps the request."""
    async def run():
        r = pdd_request()
        r.relay_out.put_nowait(batch(0, [1, 2, 3]))
        r.main_out.put_nowait(batch(2, [9, 4]))  # disagrees at position 2
        r.relay_out.put_nowait(batch(3, [4], finish_reason=common_pb2.FINISH_REASON_LENGTH))
        return r, await collect(r)

    r, msgs = asyncio.run(run())
    assert r.tokens == [1, 2, 3, 4] and set(r.sources) == {common_pb2.ROLE_RELAY} and r.handoff_at is None
