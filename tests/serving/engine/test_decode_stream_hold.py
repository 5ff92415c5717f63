"""A DecodeStream subscription that carries its request's stream interval (`StreamHold`): RLD /
MD hold the tokens and send K at a time, so the router reads one entry per K tokens.

The spec: a held stream carries exactly the tokens (and logprobs) of the unheld one, in order;
its first batch and its end (finish, handoff, status) go at once, what was held going with the
end; between them every entry holds K tokens at least; a time bound sends what is held without
another step; a hold out of range, or a hold list that does not match the subscriptions, fails
those requests alone; a stream taking a request over sends what the other held.
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from serving.engine import decode_stream
from serving.engine.slot import RpcFailure, Slot, _deliver, _deliver_token
from serving.pb import cluster_pb2, common_pb2
from serving.router import decode_streams
from tests.support.decode_stream_fakes import Engine, Table, batch, start, until

pytestmark = pytest.mark.timeout(60)


def lp(token):
    return common_pb2.TokenLogprob(logprob=-0.5 - token / 1e3)


def feed(rng, hold_k: int | None):
    """Three requests' random streams (single tokens, logprob batches, an end) through one Sink,
    messages taken at irregular steps -> ({rid: its entries (`take`)}, the sink)."""
    slots = {r: Slot(r, asyncio.Queue()) for r in "abc"}
    sink = decode_stream.Sink(Table(slots), "relay")
    for r in "abc":
        sink.subscribe(r, cluster_pb2.StreamHold(tokens=hold_k) if hold_k else None)
    pos, ended, entries = dict.fromkeys("abc", 0), set(), {r: [] for r in "abc"}
    for step in range(40):
        for r in "abc":
            if r in ended or rng.random() < 0.2:
                continue
            kind = rng.choice(["token"] * 10 + ["logprob"] * 3 + ["finish", "handoff", "fail"] if step > 3 else
                              ["token", "logprob"])
            p, slot = pos[r], slots[r]
            if kind == "token":
                _deliver_token(slot, p, 100 + p)
            elif kind == "fail":
                _deliver(slot, RpcFailure(grpc.StatusCode.INTERNAL, "the step failed"))
            else:
                b = batch(p, [100 + p, 101 + p], finish=int(kind == "finish"), handed_off=kind == "handoff")
                if kind == "logprob":
                    b.logprobs.extend([lp(100 + p), lp(101 + p)])
                _deliver(slot, b)
            pos[r] += 1 if kind == "token" else 2
            ended |= {r} if kind in ("finish", "handoff", "fail") else set()
        if rng.random() < 0.6:
            take(sink, entries, step)
    take(sink, entries, 40)
    return entries, sink


def take(sink, entries, n) -> None:
    """The next message's entries, each as (tokens, logprob count, finish, handoff, code, message `n`)."""
    sink.check_integrity()
    for it in sink.take().items:
        b = it.batch
        entries[it.request_id].append((list(b.token_ids), len(b.logprobs), b.finish_reason, b.handed_off, it.code, n))


def _flat(entries):
    """A request's entries -> (its tokens, its logprob count, the ends (finish, handoff, code))."""
    return ([t for e in entries for t in e[0]], sum(e[1] for e in entries), [e[2:5] for e in entries if any(e[2:5])])


def test_held_streams_carry_the_same_tokens_k_at_a_time():
    for seed in range(30):
        k = (2, 3, 8)[seed % 3]
        plain, _ = feed(random.Random(seed), None)
        held, sink = feed(random.Random(seed), k)
        for r in "abc":
            flat = _flat
            assert flat(held[r]) == flat(plain[r]), (seed, r)
            ends = bool(held[r]) and any(held[r][-1][2:5])
            # a handoff or a status ends the stream in an entry of its own (a finish joins the one before),
            # what was held in the entry before it
            alone = ends and (held[r][-1][3] or held[r][-1][4])
            middle = held[r][1:-2] if alone else held[r][1:-1] if ends else held[r][1:]
            assert all(len(e[0]) >= k for e in middle), (seed, r, k, held[r])
            # the first batch and the end went at once: in the message the unheld stream sent them
            assert [held[r][i][5] for i in (0, -1)] == [plain[r][i][5] for i in (0, -1)], (seed, r)
        # every stream ended or still subscribed: nothing held past an end
        assert set(sink.held) <= set(sink.subscribed) and set(sink.holds) == set(sink.subscribed)


def test_a_stream_taking_a_request_over_sends_what_the_other_held():
    async def main():
        a = Slot("a", asyncio.Queue())
        one, two = decode_stream.Sink(Table(a=a), "main"), decode_stream.Sink(Table(a=a), "main")
        one.subscribe("a", cluster_pb2.StreamHold(tokens=8))
        for p in range(4):
            _deliver_token(a, p, 10 + p)
        assert [list(i.batch.token_ids) for i in one.take().items] == [[10]]  # the first at once, 3 held
        two.subscribe("a")
        assert [list(i.batch.token_ids) for i in two.take().items] == [[11, 12, 13]]
        assert (one.held, one.holds, a.sink, a.streams) == ({}, {}, two, 1)
        one.check_integrity()
        two.check_integrity()
    asyncio.run(main())


def test_a_bound_sends_what_is_held_and_a_hold_out_of_range_fails_its_request_alone():
    """Through gRPC (the router's Mux sends the holds): K = 100, bound 60 ms; the held tokens go
    after the bound with no other step. A hold past 1024 tokens ends that request with
    INVALID_ARGUMENT; the held one goes on."""
    async def main():
        slots = {r: Slot(r, asyncio.Queue()) for r in ("a", "big")}
        eng = Engine(slots)
        server, inst = await start(eng)
        qa, qbig = asyncio.Queue(), asyncio.Queue()
        decode_streams.subscribe(inst, "a", qa, "relay", hold=(100, 60.0))
        decode_streams.subscribe(inst, "big", qbig, "relay", hold=(5000, 0.0))
        await until(lambda: eng.sinks and "a" in eng.sinks[0].subscribed)
        sink = eng.sinks[0]
        assert sink.holds["a"] == (100, 0.06) and "big" not in sink.subscribed
        err = await asyncio.wait_for(qbig.get(), 5)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "5000" in err.message
        _deliver_token(slots["a"], 0, 7)
        assert list((await asyncio.wait_for(qa.get(), 5)).token_ids) == [7]  # the first at once
        t0 = time.perf_counter()
        for p in (1, 2, 3):
            _deliver_token(slots["a"], p, 7 + p)
        got = await asyncio.wait_for(qa.get(), 5)
        assert list(got.token_ids) == [8, 9, 10] and got.start_position == 1
        assert time.perf_counter() - t0 >= 0.05  # held to the bound, not sent with the step

        _deliver(slots["a"], batch(4, [11], finish=1))
        end = await asyncio.wait_for(qa.get(), 5)
        assert list(end.token_ids) == [11] and end.finish_reason == 1
        inst.decode_stream.close()
        await server.stop(0)
    asyncio.run(main())


def test_the_sinks_check_finds_what_disagrees():
    a = Slot("a", asyncio.Queue())
    sink = decode_stream.Sink(Table(a=a), "relay")
    sink.subscribe("a", cluster_pb2.StreamHold(tokens=4))
    _deliver_token(a, 0, 5)
    _deliver_token(a, 1, 6)
    sink.check_integrity()
    for corrupt, words in ((lambda: sink.held["a"].token_ids.extend([7, 8, 9]), "its K or more"),
                           (lambda: sink.due.update(b=1.0), "bounds without held tokens"),
                           (lambda: sink.holds.update(b=(4, 0.0)), "holds without a subscription")):
        saved = ({k: cluster_pb2.TokenBatch(start_position=v.start_position, token_ids=v.token_ids)
                  for k, v in sink.held.items()}, dict(sink.due), dict(sink.holds))
        corrupt()
        with pytest.raises(AssertionError, match=words):
            sink.check_integrity()
        assert words in decode_stream.integrity_error([object(), sink])  # what RLD's / MD's Info reports
        sink.held, sink.due, sink.holds = saved
        assert decode_stream.integrity_error([object(), sink]) == ""


def test_a_hold_list_that_does_not_match_its_subscriptions_fails_them_alone():
    async def main():
        slots = {r: Slot(r, asyncio.Queue()) for r in "xyz"}
        sink = decode_stream.Sink(Table(slots), "relay")

        async def requests():  # as a foreign client might send
            yield cluster_pb2.DecodeStreamRequest(subscribe=["z"], subscribe_hold=[cluster_pb2.StreamHold(tokens=4)])
            yield cluster_pb2.DecodeStreamRequest(subscribe=["x", "y"],
                                                  subscribe_hold=[cluster_pb2.StreamHold(tokens=4)])

        await decode_stream._read(sink, requests())
        items = sink.take().items
        assert [(i.request_id, i.code) for i in items] == [("x", grpc.StatusCode.INVALID_ARGUMENT.value[0]),
                                                           ("y", grpc.StatusCode.INVALID_ARGUMENT.value[0])]
        assert "one per subscribe (1 for 2)" in items[0].error
        assert sink.holds == {"z": (4, 0.0)} and set(sink.subscribed) == {"z"}
    asyncio.run(main())
