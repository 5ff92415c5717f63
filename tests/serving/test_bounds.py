"""Values a caller sends never reach an engine out of range (issue 17, defect 1): sampling
parameters are bounded where they are validated (top_k goes into an int32 array on every step:
2^31 used to raise on every step and wedge the engine), and token ids that arrive on MD/RLD
through HandoffTokens or PushKV's known tokens are checked against the vocabulary. A refused
call is INVALID_ARGUMENT with a sentence, and the engine goes on serving the others."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import numpy as np
import pytest

from pddjax.engines.reference import ReferenceEngine
from pddjax.model.sampling_params import SamplingParams
from serving import rpc
from serving.engine.decode import DecodeService
from serving.kvwire import chunks
from serving.pb import cluster_pb2
from tests.support.inprocess import SMALL, Ctx, Refused, engine, prefill_runs
from tests.support.inprocess import aiter as _aiter
from tests.support.samples import prompt

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams()


@pytest.mark.parametrize("params, words", [
    (SamplingParams(top_k=2**31), "top-k"),
    (SamplingParams(top_k=-1), "top-k"),
    (SamplingParams(temperature=float("nan")), "temperature"),
    (SamplingParams(temperature=float("inf")), "temperature"),
    (SamplingParams(temperature=1e6), "temperature"),
    (SamplingParams(top_p=float("nan")), "top-p"),
    (SamplingParams(top_p=0.0), "top-p"),
    (SamplingParams(seed=2**31), "seed"),
])
def test_sampling_out_of_range_is_one_sentence(params, words):
    with pytest.raises(ValueError, match=words):
        params.validate()


def test_sampling_at_its_bounds_is_accepted():
    SamplingParams(temperature=100.0, top_k=2**31 - 1, top_p=1.0, seed=2**31 - 1).validate()


def test_out_of_vocabulary_tokens_are_refused_and_the_engine_serves_on(tiny):
    vocab = tiny.config.vocab_size
    main_engine = engine(tiny)
    ref = ReferenceEngine(tiny.config, tiny.weights)
    prompts = {k: prompt(20, i) for i, k in enumerate(("bad-kv", "bad-handoff", "good"))}
    runs = prefill_runs(tiny, prompts, GREEDY)

    async def main():
        svc = DecodeService("main", main_engine, tiny.config, {})
        svc.start(asyncio.get_running_loop())
        try:
            for k, p in prompts.items():
                spec = cluster_pb2.SequenceSpec(request_id=k, prompt=p, sampling=rpc.sampling_to_pb(GREEDY),
                                                max_tokens=8)
                await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=False), Ctx())
            with pytest.raises(Refused) as kv_err:  # P's first token, out of the vocabulary
                await svc.PushKV(_aiter(chunks("bad-kv", runs["bad-kv"], 0, [vocab + 7], 4096)), Ctx())
            await svc.PushKV(_aiter(chunks("bad-handoff", runs["bad-handoff"], 0, [], 4096)), Ctx())
            with pytest.raises(Refused) as handoff_err:
                await svc.HandoffTokens(cluster_pb2.HandoffTokensRequest(
                    request_id="bad-handoff", start_position=0, token_ids=[5, 2**32 - 1], final=True), Ctx())
            # the engine serves on: a good request decodes to the reference's tokens
            want = ref.generate(prompts["good"], GREEDY, 8, ()).token_ids
            await svc.PushKV(_aiter(chunks("good", runs["good"], 0, [want[0]], 4096)), Ctx())
            slot, out = svc.slots.get("good"), []
            while True:
                batch = await asyncio.wait_for(slot.out.get(), 30)
                out += list(batch.token_ids)
                if batch.finish_reason:
                    break
            return kv_err.value, handoff_err.value, out, want
        finally:
            svc.worker.stop()

    kv_err, handoff_err, out, want = asyncio.run(main())
    assert kv_err.code == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in kv_err.message, kv_err.message
    assert handoff_err.code == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in handoff_err.message
    assert out == want


def test_a_request_larger_than_the_whole_pool_is_invalid_not_retryable(tiny):
    """Issue 17, defect 4: a pool of 16 pages holds 15 x 16 = 240 tokens per request. A
    Reserve for more is INVALID_ARGUMENT saying it can never fit (a RESOURCE_EXHAUSTED would
    be retried forever); one that fits the pool but not what is free now stays RESOURCE_EXHAUSTED."""
    eng = engine(tiny, dataclasses.replace(SMALL, num_pages=16))
    assert eng.max_sequence_tokens == 15 * 16

    def reserve(rid, n_prompt, max_tokens):
        prompt = np.random.default_rng(n_prompt).integers(3, 512, n_prompt).tolist()
        return cluster_pb2.ReserveRequest(spec=cluster_pb2.SequenceSpec(
            request_id=rid, prompt=prompt, sampling=rpc.sampling_to_pb(GREEDY), max_tokens=max_tokens))

    async def main():
        svc = DecodeService("relay", eng, tiny.config, {})
        svc.start(asyncio.get_running_loop())
        try:
            out = {}
            with pytest.raises(Refused) as never:
                await svc.Reserve(reserve("big", 40, 250), Ctx())  # 290 tokens: 19 pages
            out["never"] = never.value
            await svc.Reserve(reserve("a", 40, 150), Ctx())  # 12 pages held
            with pytest.raises(Refused) as now:
                await svc.Reserve(reserve("b", 40, 100), Ctx())  # 9 pages: fits the pool, not now
            out["now"] = now.value
            await svc.Release(cluster_pb2.ReleaseRequest(request_id="a", cancel=True), Ctx())
            await svc.Reserve(reserve("b", 40, 100), Ctx())  # now it fits
            await svc.Release(cluster_pb2.ReleaseRequest(request_id="b", cancel=True), Ctx())
            return out
        finally:
            svc.worker.stop()

    out = asyncio.run(main())
    assert out["never"].code == grpc.StatusCode.INVALID_ARGUMENT
    assert "can never fit this engine's KV pool (240 tokens per request)" in out["never"].message
    assert out["now"].code == grpc.StatusCode.RESOURCE_EXHAUSTED
    eng.check_integrity()
