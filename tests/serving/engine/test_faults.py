"""An engine step that raises (issue 17, defect 2) fails the requests of that step with INTERNAL
and a sentence, frees their pages and is never retried; the engine serves the next request;
repeated faults flip the service's health, and a quiet window restores it."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest

from pddjax.engines.reference import ReferenceEngine
from pddjax.model.sampling_params import SamplingParams
from serving import rpc
from serving.engine import faults as faults_mod
from serving.engine.decode import DecodeService
from serving.engine.slot import RpcFailure
from serving.kvwire import chunks
from serving.pb import cluster_pb2
from tests.support.inprocess import Ctx, prefill_runs
from tests.support.inprocess import aiter as _aiter
from tests.support.inprocess import engine as new_engine

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams()


def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(tiny, monkeypatch):
    engine = new_engine(tiny)
    ref = ReferenceEngine(tiny.config, tiny.weights)
    names = ["poison-0", "victim", "poison-1", "poison-2", "good"]
    prompts = {k: np.random.default_rng(i).integers(3, 512, 20).tolist() for i, k in enumerate(names)}
    want = {k: ref.generate(p, GREEDY, 6, ()).token_ids for k, p in prompts.items()}
    runs = prefill_runs(tiny, prompts, GREEDY)
    real = engine._sampling_arrays

    def poisoned(rows, *args):  # what an out-of-range value once did on every step: raise
        if any(seq.seq_id.startswith("poison") for seq, _ in rows):
            raise OverflowError("Python int too large to convert to C int")
        return real(rows, *args)

    monkeypatch.setattr(engine, "_sampling_arrays", poisoned)
    monkeypatch.setattr(faults_mod, "FAULT_WINDOW_S", 600.0)  # the three faults are in one window
    health: list[bool] = []

    async def main():
        svc = DecodeService("main", engine, tiny.config, {})
        svc.start(asyncio.get_running_loop())
        svc.worker.faults.post_health = health.append
        used_idle = engine.allocator.num_used

        async def run(*rids) -> dict:
            for k in rids:
                spec = cluster_pb2.SequenceSpec(request_id=k, prompt=prompts[k], sampling=rpc.sampling_to_pb(GREEDY),
                                                max_tokens=6)
                await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=False), Ctx())
            slots = {k: svc.slots.get(k) for k in rids}
            for k in rids:  # MD in pdd: KV in, paused until RLD's tokens come
                await svc.PushKV(_aiter(chunks(k, runs[k], 0, [], 4096)), Ctx())
            gate = threading.Event()  # hold the engine thread: every handoff lands before the next step
            blocked = svc.worker.call(lambda e: gate.wait())
            handoffs = [asyncio.create_task(svc.HandoffTokens(cluster_pb2.HandoffTokensRequest(
                request_id=k, start_position=0, token_ids=want[k][:1], final=True), Ctx())) for k in rids]
            await asyncio.sleep(0.1)
            gate.set()
            await blocked
            await asyncio.gather(*handoffs)
            out = {}
            for k, slot in slots.items():
                toks = []
                while True:
                    item = await asyncio.wait_for(slot.out.get(), 20)  # a retried step never ends these
                    if isinstance(item, RpcFailure):
                        out[k] = item
                        break
                    toks += list(item.token_ids)
                    if item.finish_reason:
                        out[k] = toks
                        break
            return out

        try:
            first = await run("poison-0", "victim")  # one step: both fail
            steps_after = svc.worker.steps
            await asyncio.sleep(0.3)
            idle_steps = svc.worker.steps - steps_after  # no busy retry loop
            pages_after = engine.allocator.num_used
            good = await run("good")
            for k in ("poison-1", "poison-2"):  # the third fault within the window: NOT_SERVING
                await run(k)
            unhealthy = list(health)
            monkeypatch.setattr(faults_mod, "FAULT_WINDOW_S", 0.2)  # ... and then a quiet one passes
            await asyncio.sleep(0.4)
            await svc.worker.call(lambda e: None)  # the engine thread looks again (after this call): SERVING
            for _ in range(100):
                if len(health) > len(unhealthy):
                    break
                await asyncio.sleep(0.02)
            snap = await svc.worker.call(lambda e: svc.worker.snapshot())
            return first, idle_steps, used_idle, pages_after, good, unhealthy, list(health), snap
        finally:
            svc.worker.stop()

    first, idle_steps, used_idle, pages_after, good, unhealthy, health_end, snap = asyncio.run(main())
    for k in ("poison-0", "victim"):
        assert isinstance(first[k], RpcFailure) and first[k].code == grpc.StatusCode.INTERNAL, first[k]
        assert "engine step failed (OverflowError" in first[k].message and k in first[k].message
    assert idle_steps == 0 and pages_after == used_idle  # never retried; their pages are free
    assert good["good"] == want["good"][1:]  # the engine serves on, token-exact (MD emits from the handoff)
    assert unhealthy == [False] and health_end == [False, True]
    assert snap["faults"] == 3
    engine.check_integrity()
