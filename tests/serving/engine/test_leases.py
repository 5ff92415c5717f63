"""P's KV lease and late messages (issue 8, point 4). Real P and RLD processes (tiny model); P
reaches RLD through an emulated WAN link, so the test can delay or blackhole RLD's answers.

  - P holds a finished prefill's pages for its target until the target acknowledges the import
    (PushKV answered), and frees them at once then; its prefix cache serves the prompt meanwhile;
  - a target that never acknowledges (its answers blackholed): P frees after PDDJAX_KV_LEASE_SECONDS
    and reports DEADLINE_EXCEEDED; the acknowledgement arriving late changes nothing;
  - KV chunks arriving for a request already released are dropped (ABORTED), nothing leaks;
  - every service ends idle: no request, no page, integrity holds, `pddjax_kv_pages_active` 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import grpc
import numpy as np
import pytest

from pddjax.kv.canonical import KVRun
from pddjax.kv.page_hash import chain_hashes
from pddjax.wan.emulator import B_TO_A
from serving import kvwire
from serving.pb import cluster_pb2, cluster_pb2_grpc, common_pb2
from serving.stack.up import spawn, stop_all, wait_ready
from tests.support.serving_stack import TINY_ENGINE, LinkThread
from tests.support.stack_checks import pages_active_gauge

pytestmark = pytest.mark.timeout(180)
KV_LEASE_S = 6.0
ENV = {"PDDJAX_KV_LEASE_SECONDS": str(KV_LEASE_S), "PDDJAX_PUSH_STALL_SECONDS": "600"}  # the lease, not the stall timer
STACK = {"model": "tiny", "platform": "cpu", "engine": TINY_ENGINE}


class LeaseStack:
    def __init__(self, workdir: str):
        self.children, self.link = [], None
        self.log = open(os.path.join(workdir, "services.log"), "ab")  # noqa: SIM115  (closed in close())
        try:
            cfg = os.path.join(workdir, "stack.json")
            with open(cfg, "w") as f:
                json.dump(STACK, f)
            self.children = [spawn(r, cfg, workdir, log=self.log) for r in ("prefill", "relay")]
            asyncio.run(wait_ready(self.children, 180))
            self.p, self.rld = (c.address for c in self.children)
            self.link = LinkThread(self.rld)  # P -> link -> RLD
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        stop_all(self.children)
        if self.link is not None:
            self.link.close()
        self.log.close()

    def on_link(self, fn_name: str, *args, **kw) -> None:
        async def call():
            getattr(self.link.link.emulator, fn_name)(*args, **kw)
        asyncio.run_coroutine_threadsafe(call(), self.link.loop).result(10)

    def info(self, address: str) -> cluster_pb2.ServiceInfo:
        stub = cluster_pb2_grpc.PrefillStub if address == self.p else cluster_pb2_grpc.DecodeStub
        with grpc.insecure_channel(address) as ch:
            i = stub(ch).Info(cluster_pb2.InfoRequest(), timeout=10)
        assert not i.integrity_error, (address, i.integrity_error)
        return i

    def assert_idle(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            busy = {a: (i.requests, i.pages_active) for a in (self.p, self.rld) for i in [self.info(a)]
                    if i.requests or i.pages_active}
            busy.update({c.role: g for c in self.children for g in [pages_active_gauge(c.metrics)] if g})
            if not busy:
                return
            assert time.monotonic() < deadline, busy
            time.sleep(0.2)


make_stack = LeaseStack  # the `stack` fixture (tests/serving/conftest.py), started with ENV set


def spec(rid: str, n: int = 100, seed: int = 0) -> cluster_pb2.SequenceSpec:
    prompt = np.random.default_rng(seed).integers(3, 500, n).tolist()
    return cluster_pb2.SequenceSpec(request_id=rid, prompt=prompt, sampling=common_pb2.Sampling(), max_tokens=4)


def prefill_via_link(stack, sp):
    """Reserve on RLD, then P.Prefill pushing to RLD through the link -> (events, P's Info at
    `prefilled`, P's Info right after `transfer_done`, seconds between the two events)."""
    with grpc.insecure_channel(stack.rld) as ch:
        cluster_pb2_grpc.DecodeStub(ch).Reserve(cluster_pb2.ReserveRequest(spec=sp, use_cache=False), timeout=30)
    target = cluster_pb2.KVTarget(address=stack.link.address, start=0, role=common_pb2.ROLE_RELAY)
    events, at_prefilled, at_done, t = [], None, None, {}
    with grpc.insecure_channel(stack.p) as ch:
        for ev in cluster_pb2_grpc.PrefillStub(ch).Prefill(
                cluster_pb2.PrefillRequest(spec=sp, targets=[target], chunk_bytes=4096), timeout=120):
            events.append(ev)
            t[ev.WhichOneof("event")] = time.monotonic()
            if ev.HasField("prefilled"):
                at_prefilled = stack.info(stack.p)
            else:  # P freed before it reported: an Info queued behind the release sees it
                at_done = stack.info(stack.p)
    return events, at_prefilled, at_done, t["transfer_done"] - t["prefilled"]


def release(address: str, rid: str, stub=cluster_pb2_grpc.DecodeStub) -> bool:
    with grpc.insecure_channel(address) as ch:
        return stub(ch).Release(cluster_pb2.ReleaseRequest(request_id=rid, cancel=True), timeout=30).found


def test_p_holds_the_kv_until_the_target_acknowledges(stack):
    stack.link.set(latency_ms=700)  # RLD's acknowledgement comes >= 1.4 s after P sent the last chunk
    try:
        sp = spec("held")
        events, at_prefilled, at_done, waited = prefill_via_link(stack, sp)
    finally:
        stack.link.set()
    done = events[-1].transfer_done
    assert done.code == 0 and done.tokens == len(sp.prompt), done
    assert waited >= 1.0, waited  # the acknowledgement crossed the link
    assert at_prefilled.requests == 1 and at_prefilled.pages_active > 0  # held for RLD meanwhile
    assert at_done.requests == 0 and at_done.pages_active == 0  # freed once acknowledged
    with grpc.insecure_channel(stack.p) as ch:  # and the prompt stays in P's prefix cache
        m = cluster_pb2_grpc.PrefillStub(ch).MatchPrefix(
            cluster_pb2.MatchPrefixRequest(page_size=16, page_hashes=chain_hashes(list(sp.prompt), 16)), timeout=10)
    assert m.matched_tokens == len(sp.prompt) // 16 * 16
    assert release(stack.rld, "held")
    stack.assert_idle()


def test_a_target_that_never_acknowledges_is_freed_after_the_lease(stack):
    prefill_via_link(stack, spec("warm", seed=1))  # P's connection to the link is up before the fault
    release(stack.rld, "warm")
    stack.on_link("inject", B_TO_A, blackhole=True)  # RLD takes the KV; its answers never reach P
    try:
        events, at_prefilled, at_done, waited = prefill_via_link(stack, spec("unacked", seed=2))
    finally:
        stack.on_link("clear_faults")  # the held answers (the ack among them) now reach P: ignored
    done = events[-1].transfer_done
    assert done.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], done
    assert "PDDJAX_KV_LEASE_SECONDS" in done.error
    assert KV_LEASE_S - 0.5 <= waited <= KV_LEASE_S + 5, waited
    assert at_prefilled.requests == 1 and at_prefilled.pages_active > 0
    assert at_done.requests == 0 and at_done.pages_active == 0
    assert not release(stack.p, "unacked", cluster_pb2_grpc.PrefillStub)  # a late Release finds nothing
    assert release(stack.rld, "unacked")
    events, _, at_done, _ = prefill_via_link(stack, spec("after", seed=3))  # P still serves
    assert events[-1].transfer_done.code == 0 and at_done.pages_active == 0
    release(stack.rld, "after")
    stack.assert_idle()


def test_kv_chunks_for_a_released_request_are_dropped(stack):
    info = stack.info(stack.rld)
    sp = spec("late", n=64, seed=4)
    rng = np.random.default_rng(0)
    shape = (info.num_layers, len(sp.prompt), info.num_kv_heads, info.head_dim)  # [L, T, K, D]
    run = KVRun(info.fingerprint, 0, rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32),
                "float32")
    chunks = kvwire.chunks("late", run, 0, [5], chunk_bytes=4096)
    assert len(chunks) >= 3

    async def main():
        async with grpc.aio.insecure_channel(stack.rld) as ch:
            stub = cluster_pb2_grpc.DecodeStub(ch)
            await stub.Reserve(cluster_pb2.ReserveRequest(spec=sp, use_cache=False), timeout=30)
            q: asyncio.Queue = asyncio.Queue()

            async def feed():
                while (c := await q.get()) is not None:
                    yield c

            call = stub.PushKV(feed())
            q.put_nowait(chunks[0])
            q.put_nowait(chunks[1])
            await asyncio.sleep(0.5)
            assert (await stub.Release(cluster_pb2.ReleaseRequest(request_id="late", cancel=True), timeout=30)).found
            for c in chunks[2:]:  # late: the request is gone
                q.put_nowait(c)
            q.put_nowait(None)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
            assert e.value.code() == grpc.StatusCode.ABORTED and "released" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:  # a push for a request never reserved
                await stub.PushKV(iter(kvwire.chunks("nobody", run, 0, [5], chunk_bytes=1 << 20)))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as e:  # a late token handoff for it
                await stub.HandoffTokens(cluster_pb2.HandoffTokensRequest(request_id="late", token_ids=[1], final=True))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(main())
    stack.assert_idle()
