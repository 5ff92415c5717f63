"""RLD's Hold (serving/engine/hold.py): the router pauses a decoding request while the user waits
for MD, and resumes it if RLD keeps the request. Held, RLD makes no tokens for it (and others go
on); resumed, it decodes on to the monolithic reference's tokens; a request that is not decoding
here (unknown, or still waiting for its KV) is answered found = false and left as it was."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pddjax.engines.reference import ReferenceEngine
from pddjax.model.sampling_params import SamplingParams
from serving import rpc
from serving.engine.decode import DecodeService
from serving.engine.slot import SlotState
from serving.kvwire import chunks
from serving.pb import cluster_pb2
from tests.support.inprocess import Ctx, engine, prefill_runs
from tests.support.inprocess import aiter as _aiter

pytestmark = pytest.mark.timeout(120)
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=5)
N = 40


async def _tokens(slot, until: int, got: list) -> None:
    """Read the slot's stream until `until` tokens (or its finish)."""
    while len(got) < until:
        batch = await asyncio.wait_for(slot.out.get(), 30)
        assert batch.start_position == len(got)
        got += list(batch.token_ids)
        if batch.finish_reason:
            return


def _drain(slot, got: list) -> None:
    while not slot.out.empty():
        batch = slot.out.get_nowait()
        assert batch.start_position == len(got)
        got += list(batch.token_ids)


def test_a_held_request_makes_no_tokens_until_resumed_then_the_reference_s(tiny):
    prompts = {rid: np.random.default_rng(i).integers(3, 512, 20 + i).tolist() for i, rid in enumerate(["a", "b"])}
    ref = ReferenceEngine(tiny.config, tiny.weights)
    want = {rid: ref.generate(p, SEEDED, N, ()).token_ids for rid, p in prompts.items()}
    runs = prefill_runs(tiny, prompts, SEEDED)

    async def main():
        svc = DecodeService("relay", engine(tiny), tiny.config, {})
        svc.start(asyncio.get_running_loop())
        try:
            spec = cluster_pb2.SequenceSpec(request_id="c", prompt=prompts["a"], sampling=rpc.sampling_to_pb(SEEDED),
                                            max_tokens=N)
            await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=False), Ctx())
            waiting = await svc.Hold(cluster_pb2.HoldRequest(request_id="c", hold=True), Ctx())  # KV not yet here
            unknown = await svc.Hold(cluster_pb2.HoldRequest(request_id="nobody", hold=True), Ctx())
            assert svc.slots.get("c").state is SlotState.RESERVED
            for rid, p in prompts.items():
                spec = cluster_pb2.SequenceSpec(request_id=rid, prompt=p, sampling=rpc.sampling_to_pb(SEEDED),
                                                max_tokens=N)
                await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=False), Ctx())
                await svc.PushKV(_aiter(chunks(rid, runs[rid], 0, [want[rid][0]], 4096)), Ctx())  # P's first
            a, b = svc.slots.get("a"), svc.slots.get("b")
            got = {rid: [] for rid in prompts}  # from position 0: P's first token (pushed with the KV) on
            await _tokens(a, 5, got["a"])
            held = await svc.Hold(cluster_pb2.HoldRequest(request_id="a", hold=True), Ctx())
            await asyncio.sleep(0.05)  # what the engine posted before the hold landed
            _drain(a, got["a"])
            at, made = len(got["a"]), len(svc.engine.seqs["a"].generated)
            await _tokens(b, N, got["b"])  # the other request decodes to its end meanwhile
            await asyncio.sleep(0.3)
            assert a.out.empty() and len(svc.engine.seqs["a"].generated) == made  # held: nothing more
            await svc.worker.call(lambda e: svc.slots.check_integrity())
            resumed = await svc.Hold(cluster_pb2.HoldRequest(request_id="a", hold=False), Ctx())
            await _tokens(a, N, got["a"])
            await _tokens(b, N, got["b"])
            return waiting, unknown, held, resumed, at, got
        finally:
            svc.worker.stop()

    waiting, unknown, held, resumed, at, got = asyncio.run(main())
    assert not waiting.found and not unknown.found
    assert held.found and resumed.found and at < N
    assert got == want
