"""A full pool queues (issue 18, point 3): a Reserve that asks to wait for pages joins the
service's bounded FIFO and is admitted, in order, when pages free; past MAX_WAITING it is
RESOURCE_EXHAUSTED at once, past its deadline DEADLINE_EXCEEDED, and one that can never fit
is INVALID_ARGUMENT before it queues. The real Decode service (RLD role) and its engine thread,
in process, tiny model, a pool of 16 pages (240 tokens per request)."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import numpy as np
import pytest

from pddjax.model.sampling_params import SamplingParams
from serving import rpc
from serving.engine.decode import DecodeService
from serving.pb import cluster_pb2
from tests.support.inprocess import SMALL, Ctx, Refused, engine

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams()


class Deadline(Ctx):
    def __init__(self, seconds: float):
        self.seconds = seconds

    def time_remaining(self):
        return self.seconds


def reserve(rid: str, n_prompt: int, max_tokens: int, wait: bool = True) -> cluster_pb2.ReserveRequest:
    prompt = np.random.default_rng(n_prompt).integers(3, 512, n_prompt).tolist()
    return cluster_pb2.ReserveRequest(spec=cluster_pb2.SequenceSpec(
        request_id=rid, prompt=prompt, sampling=rpc.sampling_to_pb(GREEDY), max_tokens=max_tokens),
        wait_for_pages=wait)


def release(rid: str) -> cluster_pb2.ReleaseRequest:
    return cluster_pb2.ReleaseRequest(request_id=rid, cancel=True)


def run(tiny, body, max_waiting: int | None = None):
    eng = engine(tiny, dataclasses.replace(SMALL, num_pages=16))

    async def main():
        svc = DecodeService("relay", eng, tiny.config, {})
        svc.start(asyncio.get_running_loop())
        if max_waiting is not None:
            svc.pages.max_waiting = max_waiting
        try:
            return await body(svc)
        finally:
            svc.worker.stop()

    out = asyncio.run(main())
    eng.check_integrity()
    assert eng.num_pages_active == 0
    return out


def test_waiting_reserves_are_admitted_in_order_when_pages_free(tiny):
    async def body(svc):
        order = []

        async def waits(rid, n, m):
            res = await svc.Reserve(reserve(rid, n, m), Ctx())
            order.append(rid)
            return res

        await svc.Reserve(reserve("a", 40, 150), Ctx())  # 12 of 15 pages
        b = asyncio.create_task(waits("b", 40, 100))  # 9 pages: waits
        await asyncio.sleep(0.1)
        c = asyncio.create_task(waits("c", 10, 10))  # 2 pages would fit now, but b is first in line
        await asyncio.sleep(0.3)
        queued_while_a = (len(svc.pages), order[:])
        without_wait = None
        try:
            await svc.Reserve(reserve("d", 40, 100, wait=False), Ctx())
        except Refused as e:
            without_wait = e.code
        await svc.Release(release("a"), Ctx())
        rb, rc = await asyncio.wait_for(asyncio.gather(b, c), 10)
        for rid in ("b", "c"):
            await svc.Release(release(rid), Ctx())
        return queued_while_a, without_wait, order, rb, rc

    (waiting, admitted), without_wait, order, rb, rc = run(tiny, body)
    assert waiting == 2 and admitted == []  # both waited while `a` held the pages
    assert without_wait == grpc.StatusCode.RESOURCE_EXHAUSTED  # a caller that does not wait is told at once
    assert order == ["b", "c"]  # FIFO: c did not overtake b although it fitted first
    assert rb.queued_ms >= 300 and rc.queued_ms >= 200, (rb.queued_ms, rc.queued_ms)


def test_a_full_queue_refuses_at_once_and_a_deadline_ends_the_wait(tiny):
    async def body(svc):
        await svc.Reserve(reserve("a", 40, 150), Ctx())
        waiter = asyncio.create_task(svc.Reserve(reserve("b", 40, 100), Ctx()))
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(Refused) as full:  # max_waiting 1: b waits, c is refused
            await svc.Reserve(reserve("c", 40, 100), Ctx())
        refused_in = loop.time() - t0
        with pytest.raises(Refused) as never:  # 19 pages can never fit 15: not queued
            await svc.Reserve(reserve("e", 40, 250), Ctx())
        waiter.cancel()  # the caller went away: it leaves the queue
        await asyncio.sleep(0.1)
        left = len(svc.pages)
        t0 = loop.time()
        with pytest.raises(Refused) as late:
            await svc.Reserve(reserve("d", 40, 100), Deadline(0.5))
        waited = loop.time() - t0
        await svc.Release(release("a"), Ctx())
        return full.value, refused_in, never.value, left, late.value, waited

    full, refused_in, never, left, late, waited = run(tiny, body, max_waiting=1)
    print(f"refused with a full queue in {1e3 * refused_in:.1f} ms")
    assert full.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "1 requests already wait" in full.message
    assert refused_in < 0.05
    assert never.code == grpc.StatusCode.INVALID_ARGUMENT and "can never fit" in never.message
    assert left == 0
    assert late.code == grpc.StatusCode.DEADLINE_EXCEEDED and "no pages freed on relay" in late.message
    assert 0.5 <= waited < 2.0


def test_one_refusal_mapping_for_prefill_and_reserve():
    """P's Prefill and RLD / MD's Reserve answer a refused admission from the same table."""
    from serving.engine import decode, page_queue, prefill

    assert decode.refusal_status is prefill.refusal_status is page_queue.refusal_status
    got = {type(e): page_queue.refusal_status(e) for e in (page_queue.QueueFull("full"), TimeoutError("late"),
                                                          ValueError("never fits"))}
    assert got == {page_queue.QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
                   TimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED, ValueError: grpc.StatusCode.INVALID_ARGUMENT}
