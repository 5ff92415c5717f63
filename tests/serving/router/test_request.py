"""The router's per-request object and its output stream, without any service: the lifecycle
(every legal transition, every illegal one refused), holding and releasing instances, what a
request touched, `check_integrity` catching a state that disagrees with the data, and
`stream.Output` merging RLD's and MD's batches (handoff, order check, usage)."""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from serving.pb import cluster_pb2, common_pb2
from serving.router import recovery
from serving.router.metrics import RouterMetrics
from serving.router.pools import Instance
from serving.router.request import Abort, Request
from serving.router.request_state import LEGAL_TRANSITIONS, IllegalTransition, State
from serving.router.stream import Output
from tests.support.router_requests import batch, fed, pdd_request, streaming_request, walk

S = State


def path_to(target: State) -> list[State]:
    """The shortest legal path from VALIDATE to `target` (breadth first over LEGAL_TRANSITIONS)."""
    paths = {S.VALIDATE: [S.VALIDATE]}
    todo = collections.deque([S.VALIDATE])
    while todo:
        s = todo.popleft()
        for nxt in LEGAL_TRANSITIONS[s]:
            if nxt not in paths:
                paths[nxt] = paths[s] + [nxt]
                todo.append(nxt)
    return paths[target]


def test_every_state_is_reachable_and_ended_is_the_only_terminal_one():
    assert set(LEGAL_TRANSITIONS) == set(State)
    for s in State:
        assert path_to(s)[-1] is s
        assert bool(LEGAL_TRANSITIONS[s]) == (s is not S.ENDED), s


ILLEGAL = [(src, dst) for src in State for dst in State if dst not in LEGAL_TRANSITIONS[src]]


@pytest.mark.parametrize(("src", "dst"), ILLEGAL, ids=[f"{a.name}->{b.name}" for a, b in ILLEGAL])
def test_an_illegal_transition_raises_and_leaves_the_state(src, dst):
    r = walk(Request(rid="r9"), *path_to(src)[1:])
    with pytest.raises(IllegalTransition, match=f"r9: illegal transition {src.name} -> {dst.name}"):
        r.advance(dst)
    assert r.state is src and r.history == path_to(src)


def test_the_pipelines_lifecycles_pass_integrity_at_every_step():
    # pdd: RLD streams, the stream switches to MD, finishes, ends
    r = streaming_request()
    r.check_integrity()
    r.relay_out.put_nowait(cluster_pb2.TokenBatch(start_position=0, token_ids=[1]))
    r.tokens, r.sources, r.handoff_at = [1], [common_pb2.ROLE_RELAY], 1
    walk(r, S.MAIN_STREAMING).check_integrity()
    walk(r, S.FINISHED).check_integrity()
    walk(r, S.ENDED).check_integrity()
    assert (r.stage, r.admitted, r.settled) == ("stream", True, True)
    # pdd with RLD lost: MD takes over
    r = streaming_request()
    walk(r, S.RELAY_LOST).check_integrity()
    r.handoff_at = 0
    walk(r, S.MAIN_STREAMING, S.FINISHED).check_integrity()
    # pd-cross: MD from the start; pd-local: RLD only
    for pipeline, streaming in ((common_pb2.PIPELINE_PD_CROSS, S.MAIN_STREAMING),
                                (common_pb2.PIPELINE_PD_LOCAL, S.RELAY_STREAMING)):
        r = pdd_request()
        r.pipeline = pipeline
        if pipeline == common_pb2.PIPELINE_PD_CROSS:
            r.relay, r.main, r.main_asked = None, r.main_choice, [r.main_choice]
        walk(r, streaming).check_integrity()
        walk(r, S.FINISHED, S.ENDED).check_integrity()


def test_stage_names_where_generate_stood_even_after_it_settled():
    r = Request()
    assert (r.stage, r.admitted) == ("validate", False)
    walk(r, S.ADMISSION)
    assert (r.stage, r.admitted) == ("admission", False)  # refused here: no slot to leave
    walk(r, S.PLAN, S.RESERVE, S.ENDED)
    assert (r.stage, r.admitted, r.settled) == ("reserve", True, True)  # failed in RESERVE
    r = walk(pdd_request(), S.RELAY_STREAMING, S.FINISHED)
    assert r.stage == "stream"


def test_hold_counts_each_instance_once_and_settling_unloads_them():
    r = pdd_request()
    r.hold(r.prefill)
    r.hold(r.relay)
    r.hold(r.relay)
    assert (r.prefill.inflight, r.relay.inflight) == (1, 1)
    r.check_integrity()
    walk(r, S.ENDED)
    assert (r.prefill.inflight, r.relay.inflight) == (0, 0) and not r.held
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


def _pd_local_lost(r):
    r.pipeline = common_pb2.PIPELINE_PD_LOCAL
    r.history += [S.RELAY_STREAMING, S.RELAY_LOST]


def _pd_cross_from_relay(r):
    r.pipeline, r.relay, r.main, r.main_asked = common_pb2.PIPELINE_PD_CROSS, None, r.main_choice, [r.main_choice]
    r.history.append(S.RELAY_STREAMING)


@pytest.mark.parametrize("corrupt", [
    lambda r: r.held.extend([r.prefill, r.prefill]),
    lambda r: r.history.append(S.FINISHED),  # RESERVE -> FINISHED: never streamed
    lambda r: r.history.insert(0, S.PLAN),  # a life that does not start at VALIDATE
    lambda r: setattr(r, "pipeline", common_pb2.PIPELINE_AUTO),  # past PLAN with no pipeline
    lambda r: setattr(r, "sync_main", True),  # a context sync is pd-local's
    lambda r: setattr(r, "main", Instance("main", "never-asked")),
    lambda r: r.history.append(S.RELAY_STREAMING),  # pdd streaming without a reserved MD
    lambda r: r.history.append(S.MAIN_STREAMING),  # streaming from MD without its reservation
    _pd_cross_from_relay,  # RELAY_STREAMING in a pipeline without RLD
    _pd_local_lost,  # RELAY_LOST outside pdd
    lambda r: setattr(r, "handoff_at", 2),  # a handoff position but the stream never switched
    lambda r: (r.tokens.append(1), r.sources.append(common_pb2.ROLE_RELAY)),  # tokens before streaming
    lambda r: (r.history.append(S.ENDED), r.held.append(r.prefill)),  # settled, still loading
    lambda r: r.freed.append(Instance("relay", "elsewhere")),
    lambda r: setattr(r, "main_kv_ok", True),
])
def test_check_integrity_catches_corruption(corrupt):
    r = pdd_request()
    r.check_integrity()
    corrupt(r)
    with pytest.raises(AssertionError):
        r.check_integrity()


@pytest.mark.parametrize("corrupt", [
    lambda r: r.history.append(S.MAIN_STREAMING),  # switched without a handoff position
    lambda r: setattr(r, "main", None),  # streaming pdd with no MD
    lambda r: setattr(r, "relay", None),
    lambda r: r.tokens.append(1),  # a token without its source
])
def test_check_integrity_catches_a_streaming_state_that_disagrees(corrupt):
    r = streaming_request()
    r.check_integrity()
    corrupt(r)
    with pytest.raises(AssertionError):
        r.check_integrity()


def test_take_over_runs_once_and_only_from_relay_streaming():
    async def run(r):
        return await recovery.take_over(counters, r, [])

    counters = collections.Counter()
    r = walk(streaming_request(), S.RELAY_LOST)
    assert asyncio.run(run(r)) == "no MD to take over" and not counters  # lost already: no second take-over
    r = streaming_request()
    r.main_kv.set()  # P reported MD's transfer failed
    assert asyncio.run(run(r)).startswith("MD cannot take over") and counters["relay_lost"] == 1
    assert r.state is S.RELAY_LOST
    r.check_integrity()
    r = walk(streaming_request(), S.FINISHED)
    assert asyncio.run(run(r)) == "no MD to take over" and r.state is S.FINISHED


async def collect(r: Request) -> list:
    return [m async for m in Output(r, None, [], RouterMetrics()).messages()]


def test_output_switches_to_main_at_the_handoff():
    async def run():
        r = streaming_request()
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
    assert r.state is State.MAIN_STREAMING
    r.check_integrity()


def test_output_refuses_a_gap_and_raises_an_abort():
    async def run(item):
        r = streaming_request()
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
        r = streaming_request()
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
        r = streaming_request()
        r.relay_out.put_nowait(batch(0, [1, 2, 3]))
        r.main_out.put_nowait(batch(2, [9, 4]))  # disagrees at position 2
        r.relay_out.put_nowait(batch(3, [4], finish_reason=common_pb2.FINISH_REASON_LENGTH))
        return r, await collect(r)

    r, msgs = asyncio.run(run())
    assert r.tokens == [1, 2, 3, 4] and set(r.sources) == {common_pb2.ROLE_RELAY} and r.handoff_at is None


def recorder(calls: list):
    async def on_hold(hold: bool) -> None:
        await asyncio.sleep(0.08 if hold else 0)  # the pause answered after the resume is asked (0.05 s later)
        calls.append(hold)
    return on_hold


def test_output_waits_for_a_main_one_token_behind_then_switches():
    """MD one token behind the user: RLD's next batch is held back (not sent) and RLD asked to
    pause the request until MD covers the user's position and agrees, then the stream moves to
    MD (RLD released, never resumed); RLD's held batch is dropped."""
    switched, holds = [], []
    r = streaming_request()
    asyncio.run(fed(r, [("relay", batch(0, [1, 2, 3])), ("main", batch(1, [2]))],
                    [("relay", batch(3, [4])), ("main", batch(2, [3, 4]))],
                    [("relay", batch(4, [5])), ("main", batch(4, [5], finish_reason=common_pb2.FINISH_REASON_LENGTH))],
                    on_switch=lambda: switched.append(1), on_hold=recorder(holds)))
    assert r.tokens == [1, 2, 3, 4, 5] and switched == [1] and r.handoff_at == 3 and holds == [True]
    assert r.sources == [common_pb2.ROLE_RELAY] * 3 + [common_pb2.ROLE_MAIN] * 2


def test_output_stays_on_relay_when_a_main_behind_the_user_differs_at_the_next_token():
    """A heterogeneous pair (bf16 RLD, float32 MD) split at a near-tie after MD's last held token:
    MD was close enough to wait for, then made another token than the one the user already has.
    The request finishes on RLD, exactly its tokens: MD never becomes the source."""
    r, holds = streaming_request(), []
    msgs = asyncio.run(fed(r, [("relay", batch(0, [1, 2, 3])), ("main", batch(1, [2]))],
                           [("relay", batch(3, [4])), ("main", batch(2, [9, 8]))],
                           [("relay", batch(4, [5], finish_reason=common_pb2.FINISH_REASON_LENGTH))],
                           on_hold=recorder(holds)))
    assert holds == [True, False]  # RLD paused, then resumed: in the order asked
    assert r.tokens == [1, 2, 3, 4, 5] and set(r.sources) == {common_pb2.ROLE_RELAY} and r.handoff_at is None
    assert [t for m in msgs for t in m.token_ids] == [1, 2, 3, 4, 5]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_output_goes_on_with_relay_when_main_stays_behind_past_the_hold(monkeypatch):
    """MD close, then silent: RLD's held batches go on after HOLD_MAX_S and RLD finishes."""
    from serving.router import stream

    monkeypatch.setattr(stream, "HOLD_MAX_S", 0.2)
    r = streaming_request()
    msgs = asyncio.run(fed(r, [("relay", batch(0, [1, 2, 3])), ("main", batch(1, [2]))],
                           [("relay", batch(3, [4], finish_reason=common_pb2.FINISH_REASON_LENGTH))]))
    assert r.tokens == [1, 2, 3, 4] and set(r.sources) == {common_pb2.ROLE_RELAY}
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_a_peer_that_is_gone_is_named_in_the_abort():
    """gRPC's own words for an unreachable peer do not say which part of the stack it was."""
    from serving.router.request import from_rpc

    gone = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None,
                                "failed to connect to all addresses; last error: Connection refused")
    a = from_rpc(gone, "prefill")
    assert (a.code, a.stage) == (grpc.StatusCode.UNAVAILABLE, "prefill")
    assert a.message == "prefill unavailable: failed to connect to all addresses; last error: Connection refused"
    said = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "prefill is draining")
    assert from_rpc(said, "prefill").message == "prefill is draining"  # already named: unchanged
    other = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, None, None, "P broke")
    assert from_rpc(other, "prefill").message == "P broke"
