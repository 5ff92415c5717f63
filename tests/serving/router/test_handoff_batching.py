"""MD batches handoffs: several RLD -> MD token handoffs arriving together run as extend rows of
ONE engine step, together with MD's ordinary decode rows (no tail chunk runs alone). The real
DecodeService (MD role) and its engine thread, in process, tiny model; the handoffs are held
at the engine thread's door until all have arrived, then we count MD's steps."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pddjax.engines.paged_engine import EngineConfig, PagedEngine
from pddjax.engines.reference import ReferenceEngine
from pddjax.model.sampling_params import SamplingParams
from serving import rpc
from serving.engine.decode import DecodeService
from serving.kvwire import chunks
from serving.pb import cluster_pb2
from tests.support.inprocess import Ctx, aiter
from tests.support.samples import prompt

pytestmark = pytest.mark.timeout(400)

GREEDY = SamplingParams()


def test_several_handoffs_run_in_one_md_step_with_decode_rows(tiny):
    ref = ReferenceEngine(tiny.config, tiny.weights)
    cfg = EngineConfig(page_size=16, num_pages=128, max_step_tokens=256, max_rows=8, attention="xla")
    p_engine = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, cfg)
    md_engine = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, cfg)
    prompts = {f"h{i}": prompt(30 + 5 * i, 200 + i) for i in range(3)} | {"d0": prompt(20, 300)}
    want = {k: ref.generate(p, GREEDY, 40, ()).token_ids for k, p in prompts.items()}
    runs = {}
    for k, p in prompts.items():  # P's side: prefill, export the prompt's KV
        p_engine.add(k, p, GREEDY, 1, (), hold_on_finish=True)
        while p_engine.seqs[k].pages.num_tokens < len(p):
            p_engine.step()
        runs[k] = p_engine.export_kv(k, 0, len(p))
        p_engine.release(k)

    async def main():
        svc = DecodeService("main", md_engine, tiny.config, {})
        svc.start(asyncio.get_running_loop())
        steps: list[set[str]] = []  # seq ids with an event, per MD step
        inner = svc._on_step

        def on_step(events):
            steps.append({e.seq_id for e in events})
            inner(events)

        svc.worker.on_step = on_step
        try:
            for k, p in prompts.items():
                spec = cluster_pb2.SequenceSpec(request_id=k, prompt=p, sampling=rpc.sampling_to_pb(GREEDY),
                                                max_tokens=40)
                await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=True), Ctx())
                # d0 decodes at once (pd-cross style); h* wait for RLD's token IDs (pdd)
                known = [want[k][0]] if k == "d0" else []
                await svc.PushKV(aiter(chunks(k, runs[k], 0, known, 4096)), Ctx())
            slots = {s.request_id: s for s in svc.slots}  # a slot leaves svc.slots once its stream is closed
            # let d0 decode a little, then hold the engine thread while the handoffs arrive
            while len(md_engine.seqs["d0"].generated) < 3:
                await asyncio.sleep(0.01)
            gate = threading.Event()
            blocked = svc.worker.call(lambda e: gate.wait())
            await asyncio.sleep(0.05)
            k_rld = {"h0": 12, "h1": 20, "h2": 7}  # tokens each RLD made before MD held the KV
            calls = [asyncio.create_task(svc.HandoffTokens(cluster_pb2.HandoffTokensRequest(
                request_id=k, start_position=0, token_ids=want[k][:n], final=True), Ctx())) for k, n in k_rld.items()]
            await asyncio.sleep(0.1)  # all three are queued at the engine thread's door
            before = len(steps)
            gate.set()
            await blocked
            await asyncio.gather(*calls)
            # the first MD step after the gate: every handoff's extend row and d0's decode row
            while len(steps) == before:
                await asyncio.sleep(0.01)
            assert steps[before] == {"h0", "h1", "h2", "d0"}, steps[before:before + 3]
            # every handoff caught up in that one step: each h* sampled its next token there
            for k, n in k_rld.items():
                assert md_engine.seqs[k].generated[:n + 1] == want[k][:n + 1]
            # drain: MD's streams equal the reference from the handoff position on
            for k in prompts:
                out = []
                while True:
                    b = await slots[k].out.get()
                    out += list(b.token_ids)
                    if b.finish_reason:
                        break
                start = k_rld.get(k, 0)
                assert out == want[k][start:], k
        finally:
            svc.worker.stop()

    asyncio.run(main())
