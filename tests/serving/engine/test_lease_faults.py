"""A lease expiry that raises (serving/engine/decode.py, the lease loop of RLD / MD): one log
line, and the loop serves on. In the same sweep the other expired reservations are freed, later
ones expire too, and the reservation whose release raised still ends its stream, leaves the
slot table and frees its pages (the release is tried once more)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from serving.engine.decode import DecodeService
from serving.engine.slot import RpcFailure
from serving.pb import cluster_pb2, common_pb2
from tests.support.inprocess import Ctx, engine

pytestmark = pytest.mark.timeout(120)
LEASE_S = 0.4  # the loop looks every LEASE_S / 4


def reserve(rid: str, seed: int) -> cluster_pb2.ReserveRequest:
    prompt = [3 + (seed * 7 + i) % 500 for i in range(40)]
    return cluster_pb2.ReserveRequest(spec=cluster_pb2.SequenceSpec(
        request_id=rid, prompt=prompt, sampling=common_pb2.Sampling(), max_tokens=8), use_cache=False)


async def gone(svc: DecodeService, rids, timeout: float = 10.0) -> None:
    """Waits until none of `rids` is in the slot table; AssertionError names those left."""
    end = time.monotonic() + timeout
    while (left := [r for r in rids if r in svc.slots]) and time.monotonic() < end:
        await asyncio.sleep(0.05)
    assert not left, f"still reserved after {timeout} s: {left}"


def test_a_raising_expiry_is_logged_and_the_others_still_expire(tiny, monkeypatch, capsys):
    monkeypatch.setenv("PDDJAX_LEASE_SECONDS", str(LEASE_S))
    eng = engine(tiny)
    release, raised = eng.release, []

    def faulty_release(rid, cache=True):  # the engine's release of "bad" raises, once
        if rid == "bad" and not raised:
            raised.append(rid)
            raise RuntimeError("injected release fault")
        return release(rid, cache=cache)

    eng.release = faulty_release

    async def main():
        svc = DecodeService("relay", eng, tiny.config, {})
        svc.start(asyncio.get_running_loop())
        try:
            slots = {}
            for i, rid in enumerate(("first", "bad", "last")):  # the sweep visits them in this order
                await svc.Reserve(reserve(rid, i), Ctx())
                slots[rid] = svc.slots.get(rid)
            held = await svc.worker.call(lambda e: e.allocator.num_used)
            await gone(svc, slots)
            await svc.Reserve(reserve("later", 9), Ctx())  # the loop still runs: this one expires too
            slots["later"] = svc.slots.get("later")
            await gone(svc, ["later"])
            ends = {rid: s.out.get_nowait() for rid, s in slots.items()}
            used, seqs = await svc.worker.call(lambda e: (e.allocator.num_used, sorted(e.seqs)))
            await svc.worker.call(lambda e: (e.check_integrity(), svc.slots.check_integrity()))
            return held, ends, used, seqs, svc._lease_task.done()
        finally:
            svc._lease_task.cancel()
            svc.worker.stop()

    held, ends, used, seqs, loop_ended = asyncio.run(main())
    assert raised == ["bad"] and held > 0
    for rid, end in ends.items():  # every stream ended DEADLINE_EXCEEDED, "bad" included
        assert isinstance(end, RpcFailure) and end.code == grpc.StatusCode.DEADLINE_EXCEEDED, (rid, end)
        assert f"the reservation of {rid} on relay expired" in end.message
    assert used == 0 and seqs == [], (used, seqs)  # no page, no sequence left behind
    assert not loop_ended
    lines = [x for x in capsys.readouterr().err.splitlines() if "lease check" in x]
    assert lines == ["relay: the lease check of bad failed (RuntimeError: injected release fault)"], lines
