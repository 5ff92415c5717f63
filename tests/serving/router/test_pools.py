"""Instance selection (least loaded, session affinity, rotation, health) and the grpc.health.v1
checker against a real in-process gRPC server that goes NOT_SERVING, away, and comes back."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from serving.router import pools

pytestmark = pytest.mark.timeout(60)


def test_least_loaded_with_affinity_tiebreak_and_rotation():
    pool = pools.Pool("relay", ["a", "b", "c"])
    a, b, c = pool.instances
    assert {pool.pick().address for _ in range(3)} == {"a", "b", "c"}  # idle: rotation spreads
    a.inflight, b.inflight, c.inflight = 2, 0, 1
    assert pool.pick() is b and pool.pick(prefer="c") is b  # load first
    b.inflight = 1
    assert pool.pick(prefer="c") is c  # equal load: the session's instance
    assert pool.pick(prefer="c", exclude=[c]) is b


def test_md_affinity_is_sticky_until_unhealthy_or_excluded():
    pool = pools.Pool("main", ["m1", "m2"], ["w1", "w2"])
    m1, m2 = pool.instances
    assert m1.kv_address == "w1"
    m1.inflight = 5
    assert pool.pick(prefer="m1", sticky=True) is m1  # holds the session's context: load is secondary
    pools.set_health(m1, False)
    assert pool.pick(prefer="m1", sticky=True) is m2  # gone: least loaded of the rest
    pools.set_health(m1, True)
    assert pool.pick(prefer="m1", sticky=True, exclude=[m1]) is m2  # full (Reserve refused)
    pools.set_health(m2, False)
    with pytest.raises(pools.NoInstance):
        pool.pick(exclude=[m1])


def test_affinity_map_is_bounded():
    aff = pools.Affinity(size=2)
    aff.set("s1", "a")
    aff.set("s2", "b")
    aff.set("s1", "c")  # refreshed
    aff.set("s3", "d")  # evicts s2
    assert (aff.get("s1"), aff.get("s2"), aff.get("s3"), aff.get("")) == ("c", None, "d", None)


def test_health_checks_take_an_instance_out_and_back():
    async def main():
        async def serve(port=0):
            server = grpc.aio.server()
            hs = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(hs, server)
            port = server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            await hs.set("", health_pb2.HealthCheckResponse.SERVING)
            return server, hs, port

        server, hs, port = await serve()
        pool = pools.Pool("prefill", [f"127.0.0.1:{port}"])
        inst, counters = pool.instances[0], {}
        loop = asyncio.create_task(pools.health_loop([pool], 0.05, 1.0, counters))

        async def until(healthy):
            for _ in range(200):
                if inst.healthy == healthy:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"instance never became healthy={healthy}")

        try:
            await until(True)
            await hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await until(False)
            await hs.set("", health_pb2.HealthCheckResponse.SERVING)
            await until(True)
            await server.stop(None)  # gone
            await until(False)
            server, hs, _ = await serve(port)  # back on the same address
            await until(True)
            assert counters == {"health_left": 2, "health_back": 2}
        finally:
            loop.cancel()
            await server.stop(None)

    asyncio.run(main())


def test_what_users_see_names_no_internal_address():
    """Issue 17, defect 10: a tier's gRPC error (which names its peer's host:port) reaches the user
    with the instance's name instead, and any other host:port replaced."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            ch.unary_unary("/pddjax.Decode/Reserve")(b"", timeout=2)
        except grpc.RpcError as e:
            details = e.details()
    md = pools.Pool("main", [f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]).instances[0]
    text = f"MD cannot take over: {details}; KV via 127.0.0.1:{port + 1}; also [::1]:5000 and db.internal:6379"
    public = pools.public_text(text, [md])
    print(public)
    assert str(port) in details  # gRPC's own message names the address...
    assert str(port) not in public and str(port + 1) not in public  # ...the user's does not
    assert "MD0" in public and "5000" not in public and "6379" not in public
    assert pools.public_text("top_p must be in (0, 1], got 1.5", [md]) == "top_p must be in (0, 1], got 1.5"


def test_stats_the_operators_view_is_not_answered_to_remote_users():
    """Issue 17, defect 10: Stats lists every tenant's counters and the instances' addresses, so
    the router answers it to callers on its own host only."""
    from pddjax.model.config import TINY
    from serving.config import RouterSettings
    from serving.router.service import RouterService

    class Ctx:
        def __init__(self, peer):
            self._peer = peer

        def peer(self):
            return self._peer

        async def abort(self, code, message):
            raise grpc.RpcError(code, message)

    async def main():
        svc = RouterService(RouterSettings(prefill=["10.0.0.1:1"], relay=["10.0.0.2:1"], main=["10.0.0.3:1"]), TINY,
                            None)
        local = await svc.Stats(None, Ctx("ipv4:127.0.0.1:50312"))
        try:
            await svc.Stats(None, Ctx("ipv4:10.1.2.3:50312"))
        except grpc.RpcError as e:
            return local, e.args
        return local, None

    local, refused = asyncio.run(main())
    assert "10.0.0.3:1" in local.json  # the operator, on the router's host, sees the addresses
    assert refused is not None and refused[0] == grpc.StatusCode.PERMISSION_DENIED, refused


def test_a_slow_health_answer_counts_only_when_it_repeats():
    """A timeout (alive but busy: a service compiling on a loaded host) takes an instance out only
    after SLOW_CHECKS in a row; an answer resets the count; NOT_SERVING or a failed call counts
    at once."""
    inst = pools.Instance("prefill", "127.0.0.1:1")
    for _ in range(pools.SLOW_CHECKS - 1):
        assert pools.judge(inst, None) is True
    assert pools.judge(inst, True) is True and inst.slow_checks == 0
    answers = [pools.judge(inst, None) for _ in range(pools.SLOW_CHECKS)]
    assert answers == [True] * (pools.SLOW_CHECKS - 1) + [False]
    pools.set_health(inst, False)
    assert pools.judge(inst, None) is False  # still silent: stays out
    assert pools.judge(inst, True) is True
    assert pools.judge(inst, False) is False  # answered NOT_SERVING / refused: out at once


def test_a_live_instance_that_answers_late_stays_in_the_rotation():
    async def main():
        delay = {"s": 0.0}

        class Slow(health_pb2_grpc.HealthServicer):
            async def Check(self, request, context):
                await asyncio.sleep(delay["s"])
                return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(Slow(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pool = pools.Pool("prefill", [f"127.0.0.1:{port}"])
        inst, counters = pool.instances[0], {}
        task = asyncio.create_task(pools.health_loop([pool], 0.01, 0.1, counters))
        try:
            await asyncio.sleep(0.3)
            delay["s"] = 0.15  # each check times out
            seen = set()  # (slow checks so far, healthy) as the loop goes
            for _ in range(200):
                seen.add((min(inst.slow_checks, pools.SLOW_CHECKS), inst.healthy))
                if not inst.healthy:
                    break
                await asyncio.sleep(0.01)
            assert not inst.healthy and inst.slow_checks >= pools.SLOW_CHECKS
            assert (1, True) in seen and (pools.SLOW_CHECKS - 1, True) in seen, seen  # in through the first ones
            delay["s"] = 0.0
            for _ in range(100):
                if inst.healthy:
                    break
                await asyncio.sleep(0.02)
            assert inst.healthy and counters == {"health_left": 1, "health_back": 1}
        finally:
            task.cancel()
            await server.stop(None)

    asyncio.run(main())
