"""No unbounded waits (issue 17, defect 7), each on the real component:

  - MD's (or RLD's) reservation whose KV never comes is dropped after PDDJAX_KV_WAIT_SECONDS even
    while its Decode stream is open: the stream ends DEADLINE_EXCEEDED, the pages are free;
  - RLD's Handoff waits for decoding (its KV) at most PDDJAX_DECODING_WAIT_SECONDS;
  - a Generate that brings no deadline gets the router's default_deadline_s;
  - the router's background context syncs to MD: a bounded number wait, each has a timeout.
The Decode service runs in this process (tiny model, its real engine thread)."""

from __future__ import annotations

import asyncio
import collections
import time

import grpc
import numpy as np
import pytest

from pddjax import env
from pddjax.errors import UserError
from pddjax.model.sampling_params import SamplingParams
from serving import rpc
from serving.config import RouterSettings
from serving.engine.decode import DecodeService
from serving.pb import cluster_pb2, common_pb2
from serving.router.admission import Deadline
from tests.support.inprocess import Ctx, Refused, engine

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams()


def spec(rid: str, n: int = 20) -> cluster_pb2.SequenceSpec:
    prompt = np.random.default_rng(n).integers(3, 512, n).tolist()
    return cluster_pb2.SequenceSpec(request_id=rid, prompt=prompt, sampling=rpc.sampling_to_pb(GREEDY), max_tokens=8)


def test_a_reservation_whose_kv_never_comes_is_dropped_with_its_stream_open(tiny, monkeypatch):
    monkeypatch.setenv(env.KV_WAIT_SECONDS.name, "1")
    eng = engine(tiny)

    async def main():
        svc = DecodeService("main", eng, tiny.config, {})
        svc.start(asyncio.get_running_loop())
        try:
            await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec("r")), Ctx())
            pages_reserved = eng.num_pages_active
            t0, got = time.monotonic(), []
            with pytest.raises(Refused) as e:  # the stream the router holds open, waiting for tokens
                async for batch in svc.Decode(cluster_pb2.DecodeRequest(request_id="r"), Ctx()):
                    got.append(batch)
            waited = time.monotonic() - t0
            pages_after = await svc.worker.call(lambda e: e.num_pages_active)
            return pages_reserved, e.value, waited, pages_after, got
        finally:
            svc.worker.stop()

    reserved, err, waited, after, got = asyncio.run(main())
    print(f"stream ended after {waited:.2f} s: {err.code.name}: {err.message}")
    assert reserved > 0 and got == []
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and "no KV for r reached main within 1 s" in err.message
    assert 0.9 <= waited < 4.0  # (the lease counts from Reserve, a moment before the stream opened)
    assert after == 0
    eng.check_integrity()


def test_relays_handoff_waits_for_decoding_a_bounded_time(tiny, monkeypatch):
    monkeypatch.setenv(env.DECODING_WAIT_SECONDS.name, "0.5")

    async def main():
        svc = DecodeService("relay", engine(tiny), tiny.config, {})
        svc.start(asyncio.get_running_loop())
        try:
            await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec("r")), Ctx())
            t0 = time.monotonic()
            with pytest.raises(Refused) as e:  # its KV never lands: no decoding to hand off from
                await asyncio.wait_for(svc.Handoff(cluster_pb2.HandoffRequest(
                    request_id="r", main_address="127.0.0.1:1", mode=common_pb2.HANDOFF_MODE_CHUNKED), Ctx()), 10)
            return e.value, time.monotonic() - t0
        finally:
            svc.worker.stop()

    err, waited = asyncio.run(main())
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and "did not start decoding" in err.message, err.message
    assert 0.5 <= waited < 3.0


class NoDeadline:
    """A servicer context of a call that brought no deadline (grpc answers None)."""

    def time_remaining(self):
        return None


def test_a_generate_without_a_deadline_gets_the_default_one():
    d = Deadline.of(NoDeadline(), RouterSettings().default_deadline_s)
    assert 599 < d.remaining() <= 600
    with pytest.raises(UserError, match="default_deadline_s"):
        RouterSettings(default_deadline_s=0)


def test_background_syncs_are_bounded_in_number_and_time():
    from serving.router.transfer import Transfers

    counters: collections.Counter = collections.Counter()
    t = Transfers.__new__(Transfers)  # only the sync bookkeeping: no pools, no estimates
    t._sync_lock, t._sync_waiting, t.counters = asyncio.Lock(), 0, counters
    t.sync_timeout_s, t.max_sync_waiting = 0.3, 2

    async def stuck(r):  # an MD or P that never answers
        await asyncio.sleep(3600)

    t._sync_one = stuck

    async def main():
        t0 = time.monotonic()
        await asyncio.gather(*(t.sync_main(None) for _ in range(5)))
        return time.monotonic() - t0

    took = asyncio.run(main())
    # one runs, two wait (then run), two are dropped at once; the three that ran timed out
    assert counters == {"sync_main.dropped": 2, "sync_main.timed_out": 3}
    assert took < 3 * 0.3 + 1.0
