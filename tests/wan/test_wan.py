"""The WAN emulator: shaping math (pure) and the proxy over loopback, with faults."""

import asyncio

import pytest

from pddjax.wan.emulator import A_TO_B, WanEmulator
from pddjax.wan.shaping import LinkProfile, Wire


def test_bandwidth_and_latency_schedule():
    w = Wire(LinkProfile(mbps=8, latency_ms=50, burst_bytes=1000), t0=0.0)
    first = w.schedule(0.0, 1000)  # fits the burst: leaves at once
    assert first == pytest.approx(0.05)
    second = w.schedule(0.0, 100_000)  # 100 kB at 1 MB/s
    assert second == pytest.approx(0.1 + 0.05, rel=0.02)
    assert w.bytes == 101_000


def test_in_order_despite_jitter():
    w = Wire(LinkProfile(mbps=0, latency_ms=10, jitter_ms=30, jitter_dist="exponential", seed=3), t0=0.0)
    times = [w.schedule(i * 0.001, 100) for i in range(200)]
    assert times == sorted(times) and max(times) > 0.05


def test_stall_and_trace():
    w = Wire(LinkProfile(stalls=[(0.0, 2.0)], burst_bytes=1), t0=0.0)
    assert w.schedule(0.5, 10) >= 2.0
    tr = Wire(LinkProfile(trace=[(0.0, 8.0), (1.0, 80.0)], trace_loop=False, burst_bytes=1), t0=0.0)
    assert tr.rate_bps(0.5) == 1e6 and tr.rate_bps(1.5) == 10e6
    assert tr.schedule(0.0, 1_500_000) == pytest.approx(1.05, abs=0.03)  # 1 MB at 1 MB/s, then fast


def test_bad_profile_refused():
    with pytest.raises(ValueError):
        Wire(LinkProfile(mbps=-1))
    with pytest.raises(ValueError):
        Wire(LinkProfile(jitter_dist="cauchy"))


async def _echo_server():
    async def echo(r, w):
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    srv = await asyncio.start_server(echo, "127.0.0.1", 0)
    return srv, f"127.0.0.1:{srv.sockets[0].getsockname()[1]}"


async def _roundtrip(addr, payload, timeout=5.0):
    host, port = addr.split(":")
    r, w = await asyncio.open_connection(host, int(port))
    w.write(payload)
    await w.drain()
    got = b""
    try:
        while len(got) < len(payload):
            chunk = await asyncio.wait_for(r.read(65536), timeout)
            if not chunk:
                break
            got += chunk
    finally:
        w.close()
    return got


@pytest.mark.timeout(30)
def test_proxy_shapes_counts_and_injects_faults():
    async def main():
        srv, target = await _echo_server()
        emu = WanEmulator(target, LinkProfile(mbps=16, latency_ms=20, burst_bytes=4096))
        addr = await emu.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        payload = bytes(range(256)) * 1000  # 256 kB at 2 MB/s: >= 0.128 s (directions overlap)
        assert await _roundtrip(addr, payload) == payload
        assert loop.time() - t0 >= 0.15  # shaping is a lower bound; never faster than the line
        assert emu.stats()["bytes_a_to_b"] == len(payload) == emu.stats()["bytes_b_to_a"]

        emu.set_profile(LinkProfile())  # unshaped
        emu.inject(A_TO_B, flip=True)
        got = await _roundtrip(addr, b"hello world")
        assert got != b"hello world" and len(got) == 11  # one bit flipped, length kept

        emu.inject(A_TO_B, blackhole=True)
        with pytest.raises(asyncio.TimeoutError):
            await _roundtrip(addr, b"lost", timeout=0.5)
        emu.clear_faults()

        emu.inject(A_TO_B, close_after=5)
        assert await _roundtrip(addr, b"0123456789", timeout=2) == b"01234"
        emu.clear_faults()
        emu.inject(A_TO_B, reset=True)
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError, AssertionError)):
            got = await _roundtrip(addr, b"x", timeout=2)
            assert got == b"x"
        emu.clear_faults()
        assert await _roundtrip(addr, b"back") == b"back"
        await emu.close()
        srv.close()

    asyncio.run(main())
