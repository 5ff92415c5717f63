"""RLD dies after MD applied its final handoff (issue 17, defect 8): the router's take-over sends
MD a final with the tokens the user has, a prefix of RLD's. MD already holds the context and
streams from RLD's end, so it answers with the tokens in between, and the user's stream goes on
token-exact. A final whose tokens disagree with MD's is still refused."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from pddjax.engines.reference import ReferenceEngine
from pddjax.model.sampling_params import SamplingParams
from serving import rpc
from serving.engine.decode import DecodeService
from serving.kvwire import chunks
from serving.pb import cluster_pb2
from tests.support.inprocess import Ctx, Refused, engine, prefill_runs
from tests.support.inprocess import aiter as _aiter

pytestmark = pytest.mark.timeout(120)
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=5)


def test_a_second_final_with_the_users_prefix_continues_on_main(tiny):
    main_engine = engine(tiny)
    prompt = np.random.default_rng(3).integers(3, 512, 25).tolist()
    want = ReferenceEngine(tiny.config, tiny.weights).generate(prompt, SEEDED, 24, ()).token_ids
    run = prefill_runs(tiny, {"r": prompt}, SEEDED)["r"]
    n_relay, n_seen = 10, 6  # RLD handed 10 tokens; its stream broke when the user had 6

    async def main():
        svc = DecodeService("main", main_engine, tiny.config, {})
        svc.start(asyncio.get_running_loop())
        try:
            spec = cluster_pb2.SequenceSpec(request_id="r", prompt=prompt, sampling=rpc.sampling_to_pb(SEEDED),
                                            max_tokens=24)
            await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=False), Ctx())
            await svc.PushKV(_aiter(chunks("r", run, 0, [], 4096)), Ctx())
            slot = svc.slots.get("r")
            await svc.HandoffTokens(cluster_pb2.HandoffTokensRequest(
                request_id="r", start_position=0, token_ids=want[:n_relay], final=True), Ctx())
            with pytest.raises(Refused) as wrong:  # disagrees with MD at position 2: refused
                bad = [*want[:2], (want[2] + 1) % 512, *want[3:n_seen]]
                await svc.HandoffTokens(cluster_pb2.HandoffTokensRequest(
                    request_id="r", start_position=0, token_ids=bad, final=True), Ctx())
            ack = await svc.HandoffTokens(cluster_pb2.HandoffTokensRequest(
                request_id="r", start_position=0, token_ids=want[:n_seen], final=True), Ctx())
            stream = []
            while True:
                batch = await asyncio.wait_for(slot.out.get(), 30)
                assert not stream or batch.start_position == n_relay + len(stream)
                stream += list(batch.token_ids)
                if batch.finish_reason:
                    break
            return wrong.value, ack, stream
        finally:
            svc.worker.stop()

    wrong, ack, stream = asyncio.run(main())
    assert wrong.code == grpc.StatusCode.FAILED_PRECONDITION
    assert ack.emit_from == n_relay and list(ack.token_ids) == want[n_seen:n_relay]
    assert want[:n_seen] + list(ack.token_ids) + stream == want  # what the user ends up with
