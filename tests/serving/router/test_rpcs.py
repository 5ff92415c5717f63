"""The router's per-request RPCs against in-process fake stubs (no service, no engine): P's and
MD's MatchPrefix run at once, an auto pdd reserves RLD beside MD while an explicit pdd keeps MD
first, and P gets no Release after its Prefill call ended OK (but does after it failed), nor does a
tier whose stream brought the request's finish."""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from serving.config import RouterSettings
from serving.pb import cluster_pb2, common_pb2
from serving.router import pools
from serving.router.choose import Chooser
from serving.router.estimates import Estimates
from serving.router.metrics import RouterMetrics
from serving.router.request import Abort, Request
from serving.router.transfer import Transfers

pytestmark = pytest.mark.timeout(30)


class FakeStub:
    """One instance's stub: records (method, time order) and runs `hooks[method]` if set."""

    def __init__(self, name: str, log: list, hooks: dict | None = None):
        self.name, self.log, self.hooks = name, log, hooks or {}

    async def _call(self, method: str, default):
        self.log.append((self.name, method, "start"))
        hook = self.hooks.get(method)
        got = await hook() if hook else default
        self.log.append((self.name, method, "end"))
        return got

    def Info(self, req, timeout=None):
        return self._call("Info", cluster_pb2.ServiceInfo(page_size=16, num_pages=64))

    def MatchPrefix(self, req, timeout=None):
        return self._call("MatchPrefix", cluster_pb2.MatchPrefixResponse(matched_tokens=16))

    def Reserve(self, req, timeout=None):
        return self._call("Reserve", cluster_pb2.ReserveResponse(cached_tokens=0))

    def Release(self, req, timeout=None):
        return self._call("Release", cluster_pb2.ReleaseResponse(found=True))


def wire(inst: pools.Instance, stub: FakeStub) -> None:
    inst.channel = object()
    inst.stub = (inst.channel, stub)  # pools.stub(inst) answers it


def setup(hooks: dict | None = None):
    log, hooks = [], hooks or {}
    s = RouterSettings(prefill="p:1", relay="r:1", main="m:1", wan_probe=False)
    by_role = {role: pools.Pool(role, getattr(s, role)) for role in ("prefill", "relay", "main")}
    for pool in by_role.values():
        for inst in pool.instances:
            wire(inst, FakeStub(inst.name, log, hooks.get(inst.name)))
    counters = collections.Counter()
    chooser = Chooser(by_role, s, Estimates(s), counters, RouterMetrics())
    transfers = Transfers(s, by_role["prefill"], Estimates(s), counters, RouterMetrics())
    return log, by_role, chooser, transfers


def request(pipeline: int) -> Request:
    return Request(rid="rid1", prompt=list(range(40)), max_tokens=8, requested=pipeline,
                   spec=cluster_pb2.SequenceSpec(request_id="rid1", prompt=list(range(40)), max_tokens=8))


def both_started(log: list, a: str, b: str, method: str):
    """A hook that returns only once `a` and `b` both started `method` (serial calls time out)."""
    async def hook():
        async def wait():
            while not {(a, method, "start"), (b, method, "start")} <= set(log):
                await asyncio.sleep(0.001)
        await asyncio.wait_for(wait(), 1.0)
        return None
    return hook


def test_plan_asks_p_and_md_for_their_prefix_at_once():
    async def main():
        hooks: dict = {}
        log, _, chooser, _ = setup(hooks)
        for name in ("P0", "MD0"):
            barrier = both_started(log, "P0", "MD0", "MatchPrefix")

            async def hit(barrier=barrier):
                await barrier()
                return cluster_pb2.MatchPrefixResponse(matched_tokens=16)
            hooks[name] = {"MatchPrefix": hit}
        for inst in (*chooser.pools["prefill"].instances, *chooser.pools["main"].instances):
            inst.stub[1].hooks = hooks[inst.name]
        r = request(common_pb2.PIPELINE_PDD)
        await chooser.plan(r)
        assert (r.prefill.name, r.main_choice.name, r.relay.name) == ("P0", "MD0", "RLD0")
        assert (r.hit_prefill, r.hit_main) == (16, 16)
        assert r.explain.startswith("pdd (requested): hit P 16/40, MD 16/40")

        # P has no instance: UNAVAILABLE, whatever MD answered (as when P was asked first)
        log, by_role, chooser, _ = setup()
        by_role["prefill"].instances[0].healthy = False
        with pytest.raises(Abort) as e:
            await chooser.plan(request(common_pb2.PIPELINE_PDD))
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "prefill" in e.value.message
        # auto with no MD left: served pd-local, not failed
        log, by_role, chooser, _ = setup()
        by_role["main"].instances[0].healthy = False
        r = request(common_pb2.PIPELINE_AUTO)
        await chooser.plan(r)
        assert (r.pipeline, r.reason, r.main_choice) == (common_pb2.PIPELINE_PD_LOCAL, "no-main", None)
    asyncio.run(main())


async def planned(chooser, pipeline: int) -> Request:
    r = request(pipeline)
    await chooser.plan(r)
    return r


def test_auto_pdd_reserves_rld_beside_md_and_an_explicit_pdd_keeps_md_first():
    async def main():
        log, _, chooser, _ = setup()
        r = await planned(chooser, common_pb2.PIPELINE_PDD)
        del log[:]
        await chooser.reserve(r)
        assert [x[:2] for x in log if x[1] == "Reserve"] == [("MD0", "Reserve"), ("MD0", "Reserve"),
                                                               ("RLD0", "Reserve"), ("RLD0", "Reserve")]
        assert log.index(("MD0", "Reserve", "end")) < log.index(("RLD0", "Reserve", "start"))

        log, _, chooser, _ = setup()
        r = await planned(chooser, common_pb2.PIPELINE_AUTO)
        r.pipeline = common_pb2.PIPELINE_PDD  # whatever the policy chose: the pdd case runs both at once
        barrier = both_started(log, "MD0", "RLD0", "Reserve")
        for inst in (r.main_choice, r.relay):
            async def reserve(barrier=barrier):
                await barrier()
                return cluster_pb2.ReserveResponse(cached_tokens=16)
            inst.stub[1].hooks = {"Reserve": reserve}
        await chooser.reserve(r)
        assert (r.main, r.cached_main, r.cached_relay) == (r.main_choice, 16, 16)

        # auto pdd, MD full: pd-local with RLD's reservation (made beside MD's)
        log, _, chooser, _ = setup()
        r = await planned(chooser, common_pb2.PIPELINE_AUTO)
        r.pipeline = common_pb2.PIPELINE_PDD

        async def full():
            raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, None, None, "MD full")
        r.main_choice.stub[1].hooks = {"Reserve": full}
        await chooser.reserve(r)
        assert (r.pipeline, r.reason, r.main) == (common_pb2.PIPELINE_PD_LOCAL, "main-full", None)
        assert r.relay in r.held and ("RLD0", "Reserve", "end") in log
    asyncio.run(main())


class FakePrefillCall:
    def __init__(self, events, error=None):
        self.events, self.error = events, error

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for ev in self.events:
            yield ev
        if self.error is not None:
            raise self.error


def test_p_is_released_only_if_its_prefill_call_did_not_end_ok():
    async def main():
        for error in (None, grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, None, None, "P broke")):
            log, _, chooser, transfers = setup()
            r = await planned(chooser, common_pb2.PIPELINE_PD_LOCAL)
            await chooser.reserve(r)
            events = [cluster_pb2.PrefillEvent(prefilled=cluster_pb2.Prefilled(first_token=3))]
            r.prefill.stub[1].Prefill = lambda req, timeout=None, e=error, ev=events: FakePrefillCall(ev, e)
            await transfers._prefill(r, cluster_pb2.PrefillRequest(spec=r.spec, targets=[cluster_pb2.KVTarget(
                address="r:1", role=common_pb2.ROLE_RELAY)]))
            del log[:]
            await transfers.release(r)
            released = sorted(name for name, method, at in log if method == "Release" and at == "start")
            assert released == (["RLD0"] if error is None else ["P0", "RLD0"]), (error, released)
            assert r.freed == ([r.prefill] if error is None else [])
    asyncio.run(main())


class FakeMux:
    def __init__(self, inst):
        self.inst = inst

    def forget(self, sub) -> None:
        pass

    def unsubscribe(self, sub) -> None:
        pass


def test_a_tier_whose_stream_brought_the_finish_gets_no_release():
    """RLD sent the request's finish: it closed and freed the request itself, so the router sends
    it no Release (one RPC less per request); a stream that ended without a finish (the router
    stopped it: a stop string, a cancel) is released."""
    from serving.router import decode_streams

    async def main():
        out = {}
        for finish in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_UNSPECIFIED):
            log, _, chooser, transfers = setup()
            r = await planned(chooser, common_pb2.PIPELINE_PD_LOCAL)
            await chooser.reserve(r)
            sub = decode_streams.Subscription(FakeMux(r.relay), r.rid, asyncio.Queue(), "relay")
            r.tasks.append(sub)
            sub.deliver(cluster_pb2.RequestTokens(request_id=r.rid, batch=cluster_pb2.TokenBatch(
                start_position=0, token_ids=[5, 6], finish_reason=finish)))
            r.freed.append(r.prefill)  # its Prefill call ended OK
            del log[:]
            await transfers.release(r)
            out[finish] = sorted(name for name, method, at in log if method == "Release" and at == "start")
        return out

    out = asyncio.run(main())
    assert out == {common_pb2.FINISH_REASON_LENGTH: [], common_pb2.FINISH_REASON_UNSPECIFIED: ["RLD0"]}
