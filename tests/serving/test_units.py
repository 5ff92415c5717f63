"""Serving pieces without processes: the KV chunk protocol, the WAN link, configs, the CLI."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from pddjax.errors import UserError
from pddjax.kv.canonical import KVRun
from serving import kvwire
from serving.config import service_config
from serving.stack.wanlink import WanLink
from tests.support.samples import run_of

pytestmark = pytest.mark.timeout(60)


def test_chunks_roundtrip_in_about_chunk_bytes():
    run = run_of(40)
    pieces = list(kvwire.chunks("r", run, 8, [7], 4096))  # 512 B per token -> 8 tokens per chunk
    assert [c.seq for c in pieces] == [0, 1, 2, 3] and pieces[-1].last and list(pieces[-1].known_tokens) == [7]
    assert pieces[0].HasField("header") and not pieces[1].HasField("header") and not pieces[0].known_tokens
    assert all(len(c.k) + len(c.v) <= 4096 for c in pieces)
    asm = kvwire.Assembler("fp")
    parts = [asm.feed(c) for c in pieces]
    k = np.concatenate([p.k for p in parts], axis=1)
    assert parts[0].start == 8 and np.array_equal(k, run.k[:, 8:]) and asm.bytes == 32 * 512


def test_bfloat16_chunks_roundtrip():
    import ml_dtypes

    run = run_of(10, ml_dtypes.bfloat16)
    (c,) = kvwire.chunks("r", run, 0, [], 1 << 20)
    assert np.array_equal(kvwire.Assembler("fp").feed(c).k, run.k)


@pytest.mark.parametrize("damage,code", [
    ("flip", "DATA_LOSS"), ("drop", "DATA_LOSS"), ("swap", "DATA_LOSS"), ("foreign", "FAILED_PRECONDITION"),
    ("truncate", "DATA_LOSS")])
def test_damaged_streams_are_refused(damage, code):
    pieces = list(kvwire.chunks("r", run_of(40), 0, [], 4096))
    if damage == "flip":
        b = bytearray(pieces[1].k)
        b[3] ^= 1
        pieces[1].k = bytes(b)
    elif damage == "drop":
        del pieces[1]
    elif damage == "swap":
        pieces[1], pieces[2] = pieces[2], pieces[1]
    elif damage == "foreign":
        pieces[0].header.fingerprint = "other"
    elif damage == "truncate":
        pieces[2].last = True
    asm = kvwire.Assembler("fp")
    with pytest.raises(kvwire.WireError) as e:
        for c in pieces:
            asm.feed(c)
    assert e.value.code_name == code


def test_wan_link_counts_bytes_and_delays():
    async def main():
        async def echo(r, w):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
            w.close()

        srv = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        link = WanLink("127.0.0.1", port, mbps=8.0, latency_ms=50)  # 1 MB/s
        host, lport = (await link.start()).split(":")
        r, w = await asyncio.open_connection(host, int(lport))
        t0 = time.monotonic()
        w.write(b"x" * 200_000)
        await w.drain()
        got = await r.readexactly(200_000)
        dt = time.monotonic() - t0
        w.close()
        await link.close()
        srv.close()
        return got, dt, link.stats()

    got, dt, stats = asyncio.run(main())
    assert got == b"x" * 200_000
    assert stats["bytes_a_to_b"] == 200_000 and stats["bytes_b_to_a"] == 200_000
    assert dt >= 0.2 + 0.1  # 200 KB at 1 MB/s, plus 50 ms each way (the echo is delayed twice)


def test_config_errors_are_one_sentence():
    with pytest.raises(UserError, match="unknown engine key 'pagesize'"):
        service_config({"engine": {"pagesize": 16}}, "main")
    with pytest.raises(UserError, match="dtype"):
        service_config({"main": {"dtype": "int8"}}, "main")
    with pytest.raises(UserError, match="handoff"):
        service_config({"router": {"handoff": "sometimes"}}, "router")
    cfg = service_config({"engine": {"page_size": 16}, "main": {"page_size": 32, "prefix_cache": False}}, "main", 7)
    assert cfg.engine == {"page_size": 32, "prefix_cache": False} and cfg.port == 7


def test_up_rejects_bad_flags(capsys):
    from serving.cli import main

    assert main(["up", "--wan-mbps", "-1"]) == 2
    assert "--wan-mbps must be >= 0" in capsys.readouterr().err
    assert main(["serve", "main", "--config", "/nonexistent.toml"]) == 2


def test_chunker_streams_pieces_as_prefill_progresses():
    """P exports each step's newly computed tokens; the chunker skips what precedes the
    target's start and puts the first token on the chunk that reaches the end."""
    run = run_of(40)
    ch = kvwire.Chunker("r", 12, 40, 4096)
    piece = lambda a, b: KVRun("fp", a, run.k[:, a:b], run.v[:, a:b], "float32")  # noqa: E731
    out = ch.feed(piece(0, 10)) + ch.feed(piece(10, 25)) + ch.feed(piece(25, 40), [9])
    assert [c.start for c in out] == [12, 20, 25, 33] and out[-1].last and list(out[-1].known_tokens) == [9]
    asm = kvwire.Assembler("fp")
    got = np.concatenate([asm.feed(c).k for c in out], axis=1)
    assert np.array_equal(got, run.k[:, 12:])
