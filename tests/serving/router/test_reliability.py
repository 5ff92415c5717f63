"""The router under overload, a full MD and client deadlines (issue 8, points 2, 3 and 7), over
real service processes on loopback (tiny model), plus its Prometheus metrics:

  - admission is bounded: with max_inflight=1 and max_queue=0, requests sent while one is
    served get RESOURCE_EXHAUSTED with a sentence within 2 s; the admitted one is exact;
  - an `auto` request that no MD can ever hold (MD's pool is too small) completes pd-local via
    RLD (main-too-small), token-identical to a pd-local run; an explicit pd-cross or pdd is
    INVALID_ARGUMENT saying so; one that MD cannot hold *now* (full) goes pd-local as main-full,
    and an explicit pdd keeps the retryable RESOURCE_EXHAUSTED;
  - a client deadline too short to finish -> DEADLINE_EXCEEDED, and every tier (P, RLD, MD)
    holds no request and no page soon after;
  - the router's /metrics counts what happened (TTFT, ITL, pipelines, handoffs, failures, WAN bytes).
The MD's link is slowed (3 s one way) to keep a pd-cross request in flight deterministically."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import grpc
import pytest

from pddjax.errors import UserError
from serving.client import RouterError, make_request
from serving.config import service_config
from serving.pb import cluster_pb2, cluster_pb2_grpc
from serving.router.admission import Admission, Deadline, Refused
from tests.support.samples import greedy, prompt
from tests.support.stack_checks import assert_idle, router_stats, scrape, wait_until

pytestmark = pytest.mark.timeout(400)

STACK = {
    "model": "tiny", "platform": "cpu",
    "engine": {"dtype": "float32", "page_size": 16, "num_pages": 256, "max_step_tokens": 128, "max_rows": 8},
    "main": {"num_pages": 8},  # page 0 is scratch: MD holds at most 7 x 16 = 112 tokens
    # auto always expects the delta in time (pd-cross), so only a full MD makes it pd-local
    "router": {"chunk_bytes": 4096, "max_inflight": 1, "max_queue": 0, "ttft_budget_ms": 1e9},
}
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, float32
RE, DE = grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED


def req(p, max_tokens, pipeline, **kw):
    return make_request(p, max_tokens=max_tokens, pipeline=pipeline, ignore_eos=True, **kw)


def router_metrics(stack) -> dict:
    """{(sample name, sorted label items): value} from the router's /metrics."""
    return scrape(next(c.metrics for c in stack.children if c.role == "router"))


def metric(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


# ---- admission, in process (no stack) ----------------------------------------------------
def test_admission_queues_fifo_then_refuses_and_waiters_leave_at_their_deadline():
    async def main():
        a = Admission(max_inflight=1, max_queue=2)
        await a.enter(Deadline(None))
        order = []

        async def waiter(name, dl):
            await a.enter(dl)
            order.append(name)
            a.check_integrity()
            a.leave()

        w1 = asyncio.create_task(waiter("w1", Deadline(None)))
        w2 = asyncio.create_task(waiter("w2", Deadline(None)))
        await asyncio.sleep(0)
        assert a.stats()["queued"] == 2
        with pytest.raises(Refused) as e:  # the queue is full: at once, with a sentence
            await a.enter(Deadline(None))
        assert e.value.code == RE and "max_queue 2" in e.value.message
        a.check_integrity()
        a.leave()  # the slot goes to w1, then to w2
        await asyncio.gather(w1, w2)
        assert order == ["w1", "w2"] and a.inflight == 0 and a.queued == 0

        await a.enter(Deadline(None))
        with pytest.raises(Refused) as e:  # waits in the queue until its deadline, then leaves it
            await a.enter(Deadline(0.05))
        assert e.value.code == DE and a.queued == 0
        a.leave()
        assert a.inflight == 0 and a.refused == 1
        a.check_integrity()

    asyncio.run(main())


def test_admission_limits_are_checked_in_config():
    cfg = service_config({"router": {"max_inflight": 3, "max_queue": 0}}, "router")
    assert (cfg.router.max_inflight, cfg.router.max_queue) == (3, 0)
    with pytest.raises(UserError, match="max_inflight"):
        service_config({"router": {"max_inflight": 0}}, "router")


# ---- the stack ---------------------------------------------------------------------------
def test_past_max_inflight_and_max_queue_refused_fast_admitted_exact(stack, client, ref):
    p = prompt(20, 1)
    before = router_metrics(stack)
    stack.link.set(latency_ms=3000)  # the admitted pd-cross request waits >= 3 s for its KV
    try:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            admitted = pool.submit(client.generate, req(p, 16, "pd-cross"), 120)
            wait_until(lambda: router_stats(stack.addr["router"])["admission"]["inflight"] == 1, 60,
                       "the first request admitted")

            def extra(i):
                t = time.monotonic()
                with pytest.raises(RouterError) as e:
                    client.generate(req(prompt(20, 10 + i), 8, ["auto", "pdd", "pd-cross", "pd-local"][i]), timeout=60)
                return e.value.code, str(e.value), time.monotonic() - t

            refused = list(pool.map(extra, range(4)))
            stack.link.set(latency_ms=0)
            r = admitted.result(timeout=120)
    finally:
        stack.link.set(latency_ms=0)
    for code, msg, dt in refused:
        assert code == RE and "max_inflight 1" in msg and dt < 2.0, (code, msg, dt)
    assert r.token_ids == greedy(ref, p, 16) and r.pipeline == "pd-cross"
    after = router_metrics(stack)
    assert metric(after, "pddjax_router_failures_total", code="RESOURCE_EXHAUSTED", stage="admission") - metric(
        before, "pddjax_router_failures_total", code="RESOURCE_EXHAUSTED", stage="admission") == 4
    # afterwards the stack serves normally and every tier is idle
    p2 = prompt(24, 2)
    assert client.generate(req(p2, 12, "pdd"), timeout=120).token_ids == greedy(ref, p2, 12)
    assert router_stats(stack.addr["router"])["admission"] == {"inflight": 0, "queued": 0, "refused": 4,
                                                               "max_inflight": 1, "max_queue": 0}
    assert_idle(stack, timeout=30)


def test_a_request_no_md_can_ever_hold_goes_pd_local_or_is_invalid(stack, client, ref):
    """Issue 17, defect 4: 100 + 24 tokens exceed MD's whole pool (112): auto serves it pd-local
    (reason main-too-small, no Reserve sent), an explicit pd-cross or pdd is INVALID_ARGUMENT
    saying so, not a RESOURCE_EXHAUSTED that a client would retry forever."""
    p = prompt(100, 3)
    before = router_metrics(stack)
    r = client.generate(req(p, 24, "auto"), timeout=120)
    local = client.generate(req(p, 24, "pd-local"), timeout=120)
    assert r.pipeline == "pd-local" and set(r.sources) == {"relay"}
    assert "main-too-small" in r.explain, r.explain
    assert r.token_ids == local.token_ids == greedy(ref, p, 24)
    after = router_metrics(stack)
    assert metric(after, "pddjax_router_pipeline_total", pipeline="pd-local", reason="main-too-small") - metric(
        before, "pddjax_router_pipeline_total", pipeline="pd-local", reason="main-too-small") == 1
    for pipeline in ("pd-cross", "pdd"):  # asked for MD explicitly: refused, and why
        with pytest.raises(RouterError) as e:
            client.generate(req(p, 24, pipeline), timeout=60)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert "can never fit MD's KV pool (112 tokens per request)" in str(e.value), e.value
    assert_idle(stack, timeout=30)


def test_a_full_main_sends_auto_pd_local_and_queues_an_explicit_pdd(stack, client, ref):
    """MD could hold the request but is full now (another request holds its pages): auto serves
    it pd-local at once (main-full, counted); an explicit pdd waits in MD's page queue (issue
    18, point 3) and completes token-exact once the pages free, its wait in timings and TTFT."""
    with grpc.insecure_channel(stack.addr["main"]) as ch:  # what another router's request would hold
        md = cluster_pb2_grpc.DecodeStub(ch)
        md.Reserve(cluster_pb2.ReserveRequest(spec=cluster_pb2.SequenceSpec(
            request_id="occupant", prompt=prompt(80, 9), max_tokens=16)), timeout=30)
        released = False
        try:
            p = prompt(40, 4)  # 40 + 24 tokens: MD's 7 pages could hold it, but 6 are taken
            before = router_metrics(stack)
            r = client.generate(req(p, 24, "auto"), timeout=120)
            assert r.pipeline == "pd-local" and "main-full" in r.explain, r.explain
            assert r.token_ids == greedy(ref, p, 24)
            after = router_metrics(stack)
            assert metric(after, "pddjax_router_pipeline_total", pipeline="pd-local", reason="main-full") - metric(
                before, "pddjax_router_pipeline_total", pipeline="pd-local", reason="main-full") == 1
            assert router_stats(stack.addr["router"])["counters"]["fallback.pd-local.main-full"] >= 1
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                queued = pool.submit(client.generate, req(p, 24, "pdd"), timeout=120)
                time.sleep(2.0)
                assert not queued.done()  # waiting for MD's pages, not refused
                md.Release(cluster_pb2.ReleaseRequest(request_id="occupant", cancel=True), timeout=30)
                released = True
                r = queued.result(timeout=120)
        finally:
            if not released:
                md.Release(cluster_pb2.ReleaseRequest(request_id="occupant", cancel=True), timeout=30)
    assert r.pipeline == "pdd" and r.token_ids == greedy(ref, p, 24)
    print(f"pdd waited {r.timings['queued_ms']:.0f} ms for MD's pages; TTFT {r.timings['ttft_ms']:.0f} ms")
    assert r.timings["queued_ms"] >= 1500 and r.timings["ttft_ms"] >= r.timings["queued_ms"]
    waits = metric(router_metrics(stack), "pddjax_router_page_wait_seconds_count", tier="main")
    assert waits >= 1
    assert_idle(stack, timeout=30)


def test_deadline_too_short_every_tier_released(stack, client):
    before = router_metrics(stack)
    stack.link.set(latency_ms=3000)  # MD's KV cannot arrive within the deadline
    try:
        t = time.monotonic()
        with pytest.raises(RouterError) as e:
            client.generate(req(prompt(30, 4), 16, "pd-cross"), timeout=1.0)
        assert e.value.code == DE and time.monotonic() - t < 3.0
    finally:
        stack.link.set(latency_ms=0)
    wait_until(lambda: router_stats(stack.addr["router"])["admission"]["inflight"] == 0, 10, "the router slot released")
    assert_idle(stack, timeout=30)  # P's push, MD's reservation and stream: all gone

    def counted():
        d = {k: v - before.get(k, 0.0) for k, v in router_metrics(stack).items()
             if k[0] == "pddjax_router_failures_total"}
        return sum(v for k, v in d.items() if ("code", "DEADLINE_EXCEEDED") in k[1]) == 1
    wait_until(counted, 10, "the deadline counted once in pddjax_router_failures_total")


def test_router_metrics_count_what_happened(stack, client, ref):
    before = router_metrics(stack)
    p = prompt(20, 5)
    cross = client.generate(req(p, 8, "pd-cross"), timeout=120)
    q = prompt(24, 6)
    pdd = client.generate(req(q, 40, "pdd"), timeout=120)
    assert cross.token_ids == greedy(ref, p, 8) and pdd.token_ids == greedy(ref, q, 40)
    with pytest.raises(RouterError):
        client.generate(req(p, 8, "pdd", stop_ids=[9999]), timeout=30)
    wan = (len(p) - cross.usage["cached_on_main"] + len(q) - pdd.usage["cached_on_main"]) * BYTES_PER_TOKEN
    # under heavy load RLD may finish alone: no handoff, or one done (RLD's Handoff answered, its
    # chunks in the usage) while MD never caught up to take the stream over
    handed_off = int("main" in pdd.sources or pdd.usage["handoff_chunks"] > 0)

    def d(name, **labels):
        return metric(router_metrics(stack), name, **labels) - metric(before, name, **labels)

    wait_until(lambda: d("pddjax_router_wan_bytes_total") == wan, 30, f"{wan} WAN bytes counted")
    wait_until(lambda: d("pddjax_router_handoffs_total", mode="one-shot")
               + d("pddjax_router_handoffs_total", mode="chunked") == handed_off, 10, "the handoff counted")
    for pl, r in (("pd-cross", cross), ("pdd", pdd)):
        assert d("pddjax_router_ttft_seconds_count", pipeline=pl) == 1
        assert d("pddjax_router_itl_seconds_count", pipeline=pl) == len(r.token_ids) - 1
        assert d("pddjax_router_requests_completed_total", pipeline=pl) == 1
        assert d("pddjax_router_pipeline_total", pipeline=pl, reason="requested") == 1
    assert d("pddjax_router_failures_total", code="INVALID_ARGUMENT", stage="validate") == 1
    now = router_metrics(stack)
    assert metric(now, "pddjax_router_inflight") == 0 and metric(now, "pddjax_router_queue_depth") == 0
    assert metric(now, "pddjax_rpc_total", method="Generate", code="OK") >= 2  # the service-wide ones too
