"""DecodeStream: many requests' token streams on one gRPC stream per instance (issue 18).

Service side (`serving/engine/decode_stream.py`): a subscribed request is served as its Decode
stream was (what was queued before, then each batch; a finish, a handoff or a status ends it),
a request's contiguous batches merged, every request's batches of a step in one message, and
a subscription holds the slot's lease until it ends or the caller goes.
Router side (`serving/router/decode_streams.py`): batches reach each request's queue, a stream
that breaks fails every request on it (through `on_error` with the tokens forwarded so far:
pdd's MD take-over) and the next request opens a new stream; `cancel()` unsubscribes.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from serving.engine import decode_stream
from serving.engine.slot import RpcFailure, Slot, _deliver, _deliver_token
from serving.pb import cluster_pb2, cluster_pb2_grpc
from serving.router import decode_streams
from serving.router.request import Abort
from tests.support.decode_stream_fakes import Engine, Table, batch, start, until

pytestmark = pytest.mark.timeout(60)


def test_a_subscription_is_served_as_its_decode_stream_was():
    async def main():
        a, b = Slot("a", asyncio.Queue()), Slot("b", asyncio.Queue())
        sink = decode_stream.Sink(Table(a=a, b=b), "relay")
        _deliver(a, batch(0, [5]))  # before the subscription: held in the slot's queue
        sink.subscribe("a")
        sink.subscribe("b")
        sink.subscribe("gone")
        assert (a.streams, b.streams, a.sink) == (1, 1, sink)
        for item in (batch(1, [6]), batch(2, [7])):  # one step, then the next: merged into one entry
            _deliver(a, item)
        _deliver(b, batch(0, [9], handed_off=True))  # ends b's subscription
        _deliver(b, batch(1, [10]))  # after its end: not sent
        msg = sink.take()
        got = [(i.request_id, list(i.batch.token_ids), i.batch.handed_off, i.code) for i in msg.items]
        assert got == [("a", [5, 6, 7], False, 0), ("gone", [], False, grpc.StatusCode.NOT_FOUND.value[0]),
                       ("b", [9], True, 0)]
        assert "not reserved on relay" in msg.items[1].error
        assert (b.streams, b.sink) == (0, None) and b.out.qsize() == 1  # b's later batch stayed in its queue
        _deliver(a, batch(3, [8], finish=1))
        _deliver(a, RpcFailure(grpc.StatusCode.INTERNAL, "never sent: a finished"))
        assert [(list(i.batch.token_ids), i.batch.finish_reason) for i in sink.take().items] == [([8], 1)]
        assert (a.streams, a.sink, sink.subscribed) == (0, None, {})

        c = Slot("c", asyncio.Queue())
        sink = decode_stream.Sink(Table(c=c), "main")
        sink.subscribe("c")
        _deliver(c, batch(0, [1]))
        _deliver(c, RpcFailure(grpc.StatusCode.INTERNAL, "the step failed"))
        items = sink.take().items
        assert [(i.code, i.error) for i in items] == [(0, ""), (grpc.StatusCode.INTERNAL.value[0], "the step failed")]
        assert c.streams == 0
    asyncio.run(main())


def test_a_token_delivered_alone_is_what_its_one_token_batch_would_be():
    """RLD's and MD's common row (one token, no logprob, not the last) skips building a
    TokenBatch: every message, and the slot's own queue before a subscription, are the same."""
    rng = __import__("random").Random(7)

    def deliver_all(plain: bool):
        async def main():
            slots = {r: Slot(r, asyncio.Queue()) for r in "abc"}
            sink, msgs, pos = decode_stream.Sink(Table(slots), "relay"), [], dict.fromkeys("abc", 0)
            steps = rng_steps[:]
            for n, step in enumerate(steps):
                if n == 2:
                    for r in "abc":
                        sink.subscribe(r)
                for r, kind in step:
                    slot, p = slots[r], pos[r]
                    if kind == "token" and not plain:
                        _deliver_token(slot, p, 100 + p)
                    else:
                        _deliver(slot, batch(p, [100 + p], finish=int(kind == "finish"),
                                             handed_off=kind == "handoff"))
                    pos[r] += 1
                if n % 3 != 1:  # a message taken after some steps, not others
                    msgs.append(sink.take())
            msgs.append(sink.take())
            return [m.SerializeToString() for m in msgs]
        return asyncio.run(main())

    for _ in range(20):
        rng_steps, ended = [], set()
        for _ in range(12):
            step = []
            for r in "abc":
                if r not in ended and rng.random() < 0.8:
                    kind = rng.choice(["token"] * 8 + ["finish", "handoff"])
                    step.append((r, kind))
                    if kind != "token":
                        ended.add(r)
            rng_steps.append(step)
        assert deliver_all(plain=False) == deliver_all(plain=True)


def test_one_message_per_step_for_every_request_and_cancel_unsubscribes():
    async def main():
        slots = {f"r{i}": Slot(f"r{i}", asyncio.Queue()) for i in range(3)}
        eng = Engine(slots)
        server, inst = await start(eng)
        queues = {rid: asyncio.Queue() for rid in slots}
        subs = {rid: decode_streams.subscribe(inst, rid, queues[rid], "relay") for rid in slots}
        await until(lambda: all(s.streams == 1 for s in slots.values()))
        assert len(eng.sinks) == 1  # one stream for all three
        for pos in range(4):  # four engine steps, each one post batch for every request
            for rid, slot in slots.items():
                _deliver(slot, batch(pos, [pos], finish=1 if rid == "r2" and pos == 3 else 0))
            await until(lambda pos=pos: all(q.qsize() == pos + 1 for q in queues.values()))
        assert [b.token_ids[0] for b in [queues["r0"].get_nowait() for _ in range(4)]] == [0, 1, 2, 3]
        assert subs["r2"].done() and inst.decode_stream.subs.keys() == {"r0", "r1"}
        subs["r0"].cancel()  # the router's request ended: the service's subscription too
        await until(lambda: slots["r0"].streams == 0)
        assert slots["r1"].streams == 1
        inst.decode_stream.close()  # the router gone: every subscription ends on the service
        await until(lambda: slots["r1"].streams == 0)
        await inst.channel.close()
        await server.stop(None)
    asyncio.run(main())


class Breaking(cluster_pb2_grpc.DecodeServicer):
    """Sends one batch per subscribed request, then fails the whole stream."""

    def __init__(self):
        self.opened = 0

    async def DecodeStream(self, request_iterator, context):
        self.opened += 1
        req = await request_iterator.__anext__()
        yield cluster_pb2.DecodeStreamResponse(items=[cluster_pb2.RequestTokens(request_id=rid, batch=batch(0, [4, 5]))
                                                      for rid in req.subscribe])
        await asyncio.sleep(0.05)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "RLD went away")


def test_a_broken_stream_fails_each_request_through_on_error_and_the_next_opens_a_new_one():
    async def main():
        svc = Breaking()
        server, inst = await start(svc)
        plain, taken = asyncio.Queue(), asyncio.Queue()
        seen_by_recovery = []

        async def take_over(err, seen):  # pdd's RLD: MD takes over from the tokens the user has
            seen_by_recovery.append((err.code, err.message, list(seen)))
            return batch(len(seen), [6], handed_off=True)

        decode_streams.subscribe(inst, "a", plain, "relay")
        decode_streams.subscribe(inst, "b", taken, "relay", take_over)
        first = inst.decode_stream
        got_a = [await asyncio.wait_for(plain.get(), 5), await asyncio.wait_for(plain.get(), 5)]
        got_b = [await asyncio.wait_for(taken.get(), 5), await asyncio.wait_for(taken.get(), 5)]
        assert list(got_a[0].token_ids) == [4, 5] and isinstance(got_a[1], Abort)
        assert got_a[1].code == grpc.StatusCode.UNAVAILABLE and "RLD went away" in got_a[1].message
        assert list(got_b[1].token_ids) == [6] and got_b[1].handed_off
        assert seen_by_recovery == [(grpc.StatusCode.UNAVAILABLE, "relay unavailable: RLD went away", [4, 5])]
        await until(lambda: inst.decode_stream is None)
        decode_streams.subscribe(inst, "c", asyncio.Queue(), "relay")
        assert inst.decode_stream is not first
        await until(lambda: svc.opened == 2)
        inst.decode_stream.close()
        await inst.channel.close()
        await server.stop(None)
    asyncio.run(main())


def test_a_draining_stream_ends_once_its_last_subscription_ends():
    """The service drains (SIGTERM) while the router keeps its stream open: the stream serves its
    subscription to the end, then returns, so an idle stream does not hold the drain."""
    async def main():
        a = Slot("a", asyncio.Queue())
        sink, forever = decode_stream.Sink(Table(a=a), "relay"), asyncio.Event()

        async def requests():
            yield cluster_pb2.DecodeStreamRequest(subscribe=["a"])
            await forever.wait()  # the router never stops writing

        got = []

        async def read():
            async for msg in decode_stream.serve(sink, requests()):
                got.extend((i.request_id, list(i.batch.token_ids)) for i in msg.items)

        reading = asyncio.create_task(read())
        await asyncio.sleep(0.05)
        sink.drain()
        _deliver(a, batch(0, [5]))
        await asyncio.sleep(0.05)
        open_while_subscribed = not reading.done()
        _deliver(a, batch(1, [6], finish=1))
        await asyncio.wait_for(reading, 5)
        return open_while_subscribed, got

    open_while_subscribed, got = asyncio.run(main())
    assert open_while_subscribed
    assert got == [("a", [5]), ("a", [6])]
