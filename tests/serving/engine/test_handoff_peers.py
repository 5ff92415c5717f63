"""RLD's channels to MD for the handoff (serving/engine/handoff.py, rpc.PeerChannels): the
address comes with each Handoff, so RLD refuses one that is not HOST:PORT (INVALID_ARGUMENT) or,
with `[relay] handoff_peers` set, one not listed (PERMISSION_DENIED), before any channel opens
and without touching the request, which decodes on; and it keeps at most MD_CHANNELS channels,
closing the least recently used idle one, never one under a call."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pddjax.engines.paged_engine import EngineConfig
from pddjax.engines.reference import ReferenceEngine
from pddjax.model.sampling_params import SamplingParams
from serving import rpc
from serving.engine import handoff
from serving.engine.decode import DecodeService
from serving.kvwire import chunks
from serving.pb import cluster_pb2, cluster_pb2_grpc, common_pb2
from tests.support.inprocess import Ctx, Refused, engine, prefill_runs
from tests.support.inprocess import aiter as _aiter
from tests.support.samples import prompt

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams()
POOL = EngineConfig(page_size=16, num_pages=128, max_step_tokens=64, max_rows=8, attention="xla")
MAX_TOKENS = 48


class FakeChannel:
    def __init__(self, address):
        self.address, self.closed = address, False

    async def close(self):
        await asyncio.sleep(0)  # other calls run while a channel closes
        self.closed = True


def test_peer_channels_close_the_least_recently_used_idle_one(monkeypatch):
    monkeypatch.setattr(rpc, "channel", lambda address, options=None: FakeChannel(address))
    table, made = rpc.PeerChannels(2), {}

    async def use(address):
        async with table.use(address) as ch:
            made.setdefault(address, ch)
            assert ch is made[address]  # one channel per address while it is kept

    async def main():
        for a in ("a", "b", "c"):
            await use(a)
        assert [a for a in "abc" if a in table] == ["b", "c"] and made["a"].closed
        await use("b")  # b is the most recent now: d pushes c out
        await use("d")
        assert [a for a in "bcd" if a in table] == ["b", "d"] and made["c"].closed
        async with table.use("e") as held:  # e is in use: the others close, never e
            for a in ("f", "g"):
                await use(a)
            assert not held.closed and "e" in table and len(table) == 2
        assert len(table) == 2 and not held.closed
        go = asyncio.Event()

        async def hold(address):  # calls ending together: each closes only what is idle then
            async with table.use(address) as ch:
                made[address] = ch
                await go.wait()

        tasks = [asyncio.create_task(hold(a)) for a in "hijkl"]
        await asyncio.sleep(0)
        go.set()
        await asyncio.gather(*tasks)
        assert len(table) == 2 and all(made[a].closed == (a not in table) for a in "bdhijkl")

    asyncio.run(main())


class FakeMain(cluster_pb2_grpc.DecodeServicer):
    """MD's HandoffTokens, acknowledged at once; `calls` counts them."""

    def __init__(self):
        self.calls = 0

    async def HandoffTokens(self, request, context):
        self.calls += 1
        return cluster_pb2.HandoffTokensResponse(caught_up_to=request.start_position + len(request.token_ids))


def test_a_handoff_to_an_unlisted_or_malformed_md_is_refused_and_the_rest_go_on(tiny, monkeypatch):
    monkeypatch.setenv("PDDJAX_HANDOFF_FINAL_SECONDS", "1")
    monkeypatch.setattr(handoff, "MD_CHANNELS", 2, raising=False)
    rld = engine(tiny, POOL)
    step = rld.step
    rld.step = lambda: (time.sleep(0.02), step())[1]  # RLD decodes slowly: every request is mid-stream
    rids = ["kept", "h0", "h1", "h2"]
    prompts = {rid: prompt(20, i) for i, rid in enumerate(rids)}
    runs = prefill_runs(tiny, prompts, GREEDY, POOL)
    ref = ReferenceEngine(tiny.config, tiny.weights)
    want = {rid: ref.generate(p, GREEDY, MAX_TOKENS, ()).token_ids for rid, p in prompts.items()}

    async def main():
        fake, server = FakeMain(), grpc.aio.server()
        cluster_pb2_grpc.add_DecodeServicer_to_server(fake, server)
        mds = [f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}" for _ in range(3)]  # one MD, 3 addresses
        await server.start()
        svc = DecodeService("relay", rld, tiny.config, {}, handoff_peers=mds)
        svc.start(asyncio.get_running_loop())
        try:
            for rid in rids:
                spec = cluster_pb2.SequenceSpec(request_id=rid, prompt=prompts[rid], max_tokens=MAX_TOKENS,
                                                sampling=rpc.sampling_to_pb(GREEDY))
                await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=False), Ctx())
                await svc.PushKV(_aiter(chunks(rid, runs[rid], 0, [want[rid][0]], 4096)), Ctx())
            refused = {}
            for address in ("10.0.0.9:50063", "not an address", ""):
                with pytest.raises(Refused) as e:
                    await svc.Handoff(cluster_pb2.HandoffRequest(
                        request_id="kept", main_address=address, mode=common_pb2.HANDOFF_MODE_ONE_SHOT), Ctx())
                refused[address] = e.value
            opened_by_refusals = len(svc.handoff.channels)
            handed = [await svc.Handoff(cluster_pb2.HandoffRequest(
                request_id=rid, main_address=md, mode=common_pb2.HANDOFF_MODE_ONE_SHOT), Ctx())
                for rid, md in zip(rids[1:], mds, strict=True)]
            kept, slot = [], svc.slots.get("kept")
            while True:  # the refused request decodes on, on RLD
                batch = await asyncio.wait_for(slot.out.get(), 30)
                kept += list(batch.token_ids)
                if batch.finish_reason or batch.handed_off:
                    break
            return refused, opened_by_refusals, handed, kept, fake.calls, len(svc.handoff.channels)
        finally:
            svc.worker.stop()
            await server.stop(0)

    refused, opened, handed, kept, md_calls, channels = asyncio.run(main())
    denied = refused["10.0.0.9:50063"]
    assert denied.code == grpc.StatusCode.PERMISSION_DENIED, (denied.code, denied.message)
    assert denied.message == "10.0.0.9:50063 is not one of this relay's handoff peers ([relay] handoff_peers)"
    for address in ("not an address", ""):
        r = refused[address]
        assert r.code == grpc.StatusCode.INVALID_ARGUMENT, (address, r.code, r.message)
        assert r.message == f"the handoff of kept cannot go to MD: {address!r} is not a HOST:PORT address"
    assert opened == 0  # no channel for a refused address
    assert [h.handed_off for h in handed] == [True] * 3 and md_calls == 3
    assert kept == want["kept"]  # token-exact, to its end, never handed off
    assert channels == 2  # three MD addresses, at most MD_CHANNELS channels kept
