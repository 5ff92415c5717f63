"""The router's link probe, without engines: the estimate's arithmetic and bounds (policy), the
estimator's seed / cap / source / age, MD's `Probe` RPC through the gate (an oversized payload
is refused with INVALID_ARGUMENT and a sentence), and `Estimates.probe` against a real
DecodeService's Probe behind an emulated link (20 and 100 Mb/s, 20 ms one way; a 0.2 Mb/s
line the probe's budget cuts short): it measures the line within bounds, in bounded time."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pddjax import policy
from serving import gate, rpc
from serving.config import RouterSettings, service_config
from serving.engine import probe as md_probe
from serving.engine.decode import DecodeService
from serving.pb import cluster_pb2, cluster_pb2_grpc
from serving.router import estimates, pools
from tests.support.serving_stack import LinkThread

pytestmark = pytest.mark.timeout(120)
MB = 1e6 / 8  # bytes/s per Mb/s


def test_probe_arithmetic_and_bounds():
    assert policy.probe_rtt([0.040, 0.041, 0.300]) == 0.041  # one slow answer does not move it
    assert policy.probe_rtt([]) == 0.0
    # 1 MiB in 0.46 s with a 40 ms round trip: 2.5 MB/s (20 Mb/s)
    assert abs(policy.probe_rate(1_048_576, 0.4594, 0.040) - 2.5e6) < 1e3
    # a round no longer than the RTT: a tenth of the round, never a division by ~0
    assert policy.probe_rate(32_768, 0.040, 0.041) == 32_768 / 0.004
    # next round: ~0.25 s at the measured rate, within [32 KiB, 2 MiB], whole KiB
    assert policy.probe_size(2.5e6) == int(2.5e6 * 0.25) // 1024 * 1024
    assert policy.probe_size(1.0) == policy.PROBE_FIRST_BYTES == 32 * 1024
    assert policy.probe_size(1e12) == policy.PROBE_MAX_BYTES == 2 * 1024 * 1024
    assert policy.PROBE_MAX_BYTES < md_probe.MAX_PAYLOAD_BYTES  # the router never asks what MD refuses
    # the estimate is the largest round's rate (the later one on ties)
    rounds = [(32_768, 0.050), (600_000, 0.28), (600_000, 0.30)]
    assert policy.probe_estimate(rounds, 0.04) == policy.probe_rate(600_000, 0.30, 0.04)
    assert policy.probe_estimate([], 0.04) == 0.0
    # the worst case is bounded: three rounds of at most 2 MiB, whatever the rate
    sizes, rate = [policy.PROBE_FIRST_BYTES], 1e12
    for _ in range(estimates.PROBE_ROUNDS - 1):
        sizes.append(policy.probe_size(rate))
    assert sum(sizes) <= 4.1 * 2**20


def test_estimator_seed_cap_source_and_age():
    lk = policy.LinkEstimator(1000, 0.02)
    assert (lk.source, lk.describe()) == ("prior", "prior")
    lk.seed(2.5e6, 0.041)
    assert lk.throughput.value == 2.5e6 and lk.latency.value == 0.041 and lk.source == "probe"
    assert lk.describe(now=lk.at + 3.2) == "probe, 3 s ago"
    lk.done(0, 1_000_000, 0.041 + 0.5)  # a transfer refines it (an average, the probe is a sample)
    assert lk.source == "transfers" and 2.0e6 < lk.throughput.value < 2.5e6
    lk.done(0, 1000, 0.05)  # small: latency only, the throughput's source stays
    assert lk.source == "transfers"
    # a configured capacity is the prior and the cap: nothing measured exceeds it
    cap = policy.LinkEstimator(100, 0.02, cap_mbps=100, source="configured")
    assert cap.throughput.value == 100 * MB and cap.describe() == "configured"
    cap.seed(500 * MB, 0.04)
    assert cap.throughput.value == 100 * MB and "capped at the configured 100 Mb/s" in cap.describe()
    cap.done(0, 10_000_000, 0.05)
    assert cap.throughput.value == 100 * MB
    cap.seed(20 * MB)  # below the cap: the measurement stands
    assert cap.throughput.value == 20 * MB and "capped" not in cap.describe()


def test_explain_names_the_link_estimates_source():
    i = policy.Inputs(prompt_tokens=600, max_tokens=16, hit_prefill=0, hit_main=0, kv_bytes_per_token=46_080,
                      wan_bytes_per_s=2.5e6, wan_latency_s=0.041, wan_queue_bytes=0, relay_tokens_per_s=50.0,
                      wan_source="probe, 3 s ago")
    s = policy.decide(i, policy.PolicyConfig()).explain(i)
    assert "at 20.0 Mb/s + 41 ms (probe, 3 s ago; +0 B queued)" in s, s


def test_router_settings_take_the_capacity_and_probe_keys():
    r = service_config({"router": {"wan_mbps": 100, "wan_probe": False, "wan_probe_wait_ms": 500}}, "router").router
    assert (r.wan_mbps, r.wan_probe, r.wan_probe_wait_ms) == (100, False, 500)
    with pytest.raises(Exception, match="wan_mbps"):
        RouterSettings(wan_mbps=-1)
    e = estimates.Estimates(RouterSettings(wan_mbps=50))
    lk = e.link(pools.Instance("main", "x:1"))
    assert lk.source == "configured" and lk.throughput.value == 50 * MB and lk.cap == 50 * MB


async def _md_server():
    """A Decode service (no engine: Probe needs none) behind the gate, on loopback."""
    server = grpc.aio.server(options=rpc.SERVER_OPTIONS)
    g = gate.Gate()
    gate.register(server, cluster_pb2.DESCRIPTOR.services_by_name["Decode"], g)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    g.ready(DecodeService("main", None, None, {}))
    return server, f"127.0.0.1:{port}"


def test_probe_rpc_bounds_its_payload():
    async def main():
        server, address = await _md_server()
        try:
            async with grpc.aio.insecure_channel(address, options=rpc.CHANNEL_OPTIONS) as ch:
                stub = cluster_pb2_grpc.DecodeStub(ch)
                ok = await stub.Probe(cluster_pb2.ProbeRequest(payload=bytes(md_probe.MAX_PAYLOAD_BYTES)), timeout=10)
                assert ok.bytes_received == md_probe.MAX_PAYLOAD_BYTES
                assert (await stub.Probe(cluster_pb2.ProbeRequest(), timeout=10)).bytes_received == 0
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Probe(cluster_pb2.ProbeRequest(payload=bytes(md_probe.MAX_PAYLOAD_BYTES + 1)),
                                     timeout=10)
                return e.value
        finally:
            await server.stop(0)

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "a probe payload is at most 4194304 bytes (4 MiB), got 4194305" in err.details(), err.details()


def probe_through_link(mbps: float, latency_ms: float) -> tuple[dict, policy.LinkEstimator, float]:
    """Estimates.probe of a Decode service reached through an emulated link -> (what it
    measured, the seeded estimator, seconds it took)."""
    async def main():
        server, address = await _md_server()
        link = LinkThread(address)
        link.set(mbps=mbps, latency_ms=latency_ms)
        inst = pools.Instance("main", address, link.address)
        try:
            e = estimates.Estimates(RouterSettings())
            t0 = time.perf_counter()
            out = await e.probe(inst)
            return out, e.link(inst), time.perf_counter() - t0
        finally:
            if inst.kv_channel is not None:
                await inst.kv_channel.close()
            link.close()
            await server.stop(0)

    return asyncio.run(main())


@pytest.mark.parametrize("mbps", [20, 100])
def test_probe_measures_the_emulated_link(mbps):
    out, lk, took = probe_through_link(mbps, 20)
    print(f"{mbps} Mb/s, 20 ms: {out}")
    assert not out["error"], out
    assert took < estimates.PROBE_BUDGET_S + 0.5, took
    assert 0.040 <= lk.latency.value < 0.080, out  # two 20 ms crossings (+ gRPC's own time)
    assert 0.6 * mbps <= out["mbps"] <= 1.25 * mbps, out
    assert lk.source == "probe" and abs(8 * lk.throughput.value / 1e6 - out["mbps"]) < 1e-6
    assert sum(r["bytes"] for r in out["rounds"]) <= 4.1 * 2**20


def test_probe_of_a_very_slow_line_stays_within_its_budget():
    out, lk, took = probe_through_link(0.2, 20)  # 32 KiB take 1.3 s; the next round is cut short
    print(f"0.2 Mb/s, 20 ms: {out}")
    assert took < estimates.PROBE_BUDGET_S + 0.5, (took, out)
    assert lk.source == "probe" and 8 * lk.throughput.value / 1e6 < 0.3, out


def test_a_request_waits_for_the_first_probe_boundedly_and_never_cancels_it():
    async def main():
        server, address = await _md_server()
        link = LinkThread(address)
        link.set(mbps=0.2, latency_ms=20)  # the probe takes ~3 s here
        inst = pools.Instance("main", address, link.address)
        try:
            e = estimates.Estimates(RouterSettings())
            assert e.start_probe(inst) and not e.start_probe(inst)  # one at a time
            t0 = time.perf_counter()
            await e.settled(inst, 0.5)
            waited = time.perf_counter() - t0
            task = e.probes[inst.address]
            assert not task.done()  # the wait timed out; the probe goes on
            await task
            t1 = time.perf_counter()
            await e.settled(inst, 5.0)  # measured: no wait
            again = e.start_probe(inst)  # within PROBE_MIN_INTERVAL_S of the last: not again
            return waited, time.perf_counter() - t1, again, e.link(inst).source
        finally:
            if inst.kv_channel is not None:
                await inst.kv_channel.close()
            link.close()
            await server.stop(0)

    waited, after, again, source = asyncio.run(main())
    assert 0.45 <= waited < 1.0 and after < 0.05 and not again and source == "probe", (waited, after, again)


def test_a_link_whose_probe_failed_is_probed_again_when_a_request_is_planned(monkeypatch):
    """The first probe fails (MD's port up but not serving yet, as while it compiles): the
    estimate stays the prior. Planning a request on it probes again (at most every
    PROBE_MIN_INTERVAL_S), and once MD serves the link is measured; a measured link is not probed
    again for planning."""
    monkeypatch.setattr(estimates, "PROBE_MIN_INTERVAL_S", 0.0)

    async def main():
        server = grpc.aio.server(options=rpc.SERVER_OPTIONS)
        g = gate.Gate()  # UNAVAILABLE to every call until ready
        gate.register(server, cluster_pb2.DESCRIPTOR.services_by_name["Decode"], g)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        inst = pools.Instance("main", address, address)
        try:
            e = estimates.Estimates(RouterSettings())
            failed = await e.probe(inst)
            before = e.link(inst).source
            g.ready(DecodeService("main", None, None, {}))  # MD serves now
            again = e.probe_unmeasured(inst)
            await e.probes[inst.address]
            return failed, before, again, e.link(inst).source, e.probe_unmeasured(inst)
        finally:
            if inst.kv_channel is not None:
                await inst.kv_channel.close()
            await server.stop(0)

    failed, before, again, after, twice = asyncio.run(main())
    assert failed["error"] and before == "prior", failed
    assert again and after == "probe" and not twice
