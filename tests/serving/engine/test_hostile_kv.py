"""PushKV read as an attacker would (issue 32): one MD in process (the real DecodeService, tiny
model) receives KV streams that lie. Each is refused with one sentence, the reservation it
named is failed (its pages back: pages_active 0) and nothing of it reaches MD's prefix cache:

  - a header that claims more tokens than the reservation holds (a zstd bomb: 11 KiB of frames
    that would inflate to 8,000 tokens) is refused before anything is decompressed; a stream
    within its reservation never asks the decompressor for more than the reservation's bytes;
  - a header whose layers, KV heads or head_dim differ from this model's is refused before decoding;
  - non-finite KV (NaN in any format) is refused and its prefix never becomes a DRC entry;
  - any exception while decoding (MemoryError included) fails the slot;
  - a chunk naming another request than the stream's first chunk is refused;
  - chunks are decoded off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import grpc
import numpy as np
import pytest

from pddjax.kv import codec
from pddjax.kv.canonical import KVRun
from pddjax.model.sampling_params import SamplingParams
from serving import kvwire, rpc
from serving.engine.decode import DecodeService
from serving.pb import cluster_pb2
from tests.support.inprocess import Ctx, Refused, engine
from tests.support.inprocess import aiter as _aiter
from tests.support.samples import prompt

pytestmark = pytest.mark.timeout(120)
RESERVED = 32  # prompt tokens of every reservation here
MAX_TOKENS = 8


def _run(tiny, n: int, start: int = 0, fill: float | None = None, layers: int = 2, heads: int = 2,
         dim: int = 16) -> KVRun:
    """A KV run of tokens [start, start + n) of tiny's layout (or another), random or all `fill`."""
    shape = (layers, n, heads, dim)  # [L, T, K, D]
    k = (np.full(shape, fill, np.float32) if fill is not None
         else np.random.default_rng(start).standard_normal(shape).astype(np.float32))
    return KVRun(tiny.fingerprint, start, k, -k, "float32")


@contextlib.asynccontextmanager
async def _main(tiny):
    svc = DecodeService("main", engine(tiny), tiny.config, {"role": rpc.ROLE_NAMES["main"]})
    svc.start(asyncio.get_running_loop())
    try:
        yield svc
    finally:
        svc.worker.stop()


async def _reserve(svc, rid: str, seed: int = 0) -> list[int]:
    p = prompt(RESERVED, seed)
    spec = cluster_pb2.SequenceSpec(request_id=rid, prompt=p, sampling=rpc.sampling_to_pb(SamplingParams()),
                                    max_tokens=MAX_TOKENS)
    await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=True), Ctx())
    return p


async def _refused(svc, chunks) -> Refused:
    with pytest.raises(Refused) as e:
        await asyncio.wait_for(svc.PushKV(_aiter(chunks), Ctx()), 30)
    assert "\n" not in e.value.message
    return e.value


async def _idle(svc, rid: str) -> None:
    """The refused reservation is closed: out of the table, its sequence and pages gone (the
    pages still active are those of the other reservations)."""
    for _ in range(100):  # a closed slot leaves the table on the event loop, after the engine thread's post
        if rid not in svc.slots:
            break
        await asyncio.sleep(0.01)
    assert rid not in svc.slots
    held, others = await svc.worker.call(lambda e: (rid in e.seqs, sum(len(s.pages.pages) for s in e.seqs.values())))
    assert not held
    assert await svc.worker.call(lambda e: e.num_pages_active) == others


def _record(monkeypatch, name: str) -> list:
    """Calls of codec.`name` (the arguments, and the thread that made them), passed through."""
    calls, real = [], getattr(codec, name)

    def spy(*args):
        calls.append((args, threading.current_thread()))
        return real(*args)
    monkeypatch.setattr(codec, name, spy)
    return calls


def test_a_zstd_bomb_past_the_reservation_is_refused_before_decompressing(tiny, monkeypatch):
    """8,000 tokens of zeros in native+zstd (about 11 KiB of frames) for a 32-token reservation:
    refused on the header, the decompressor never called; a stream inside the reservation asks
    it for one chunk's bytes at most, never more than the reservation's."""
    bomb = kvwire.chunks("bomb", _run(tiny, 8000, fill=0.0), 0, [], 1 << 30, "native+zstd")
    assert len(bomb) == 1 and len(bomb[0].k) + len(bomb[0].v) < 12 << 10
    unzstd = _record(monkeypatch, "_unzstd")

    async def main():
        async with _main(tiny) as svc:
            await _reserve(svc, "bomb")
            refused = await _refused(svc, bomb)
            await _idle(svc, "bomb")
            assert not unzstd  # refused on the header: nothing was inflated
            await _reserve(svc, "fits", seed=1)
            await svc.PushKV(_aiter(kvwire.chunks("fits", _run(tiny, RESERVED), 0, [], 2048, "native+zstd")),
                             Ctx())
            return refused

    refused = asyncio.run(main())
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "32" in refused.message, refused.message
    reservation = 2 * 2 * RESERVED * 2 * 16 * 4  # layers x tokens x KV heads x head_dim x float32
    asked = [args[1] for args, _ in unzstd]  # _unzstd(data, size, what)
    assert asked and max(asked) <= 2048 and sum(asked) <= reservation, asked


@pytest.mark.parametrize("layers,heads,dim", [(3, 2, 16), (2, 4, 16), (2, 2, 32)])
def test_a_header_with_another_layout_is_refused_before_decoding(tiny, monkeypatch, layers, heads, dim):
    chunks = kvwire.chunks("r", _run(tiny, RESERVED, layers=layers, heads=heads, dim=dim), 0, [], 1 << 20)
    decoded = _record(monkeypatch, "decode")

    async def main():
        async with _main(tiny) as svc:
            await _reserve(svc, "r")
            refused = await _refused(svc, chunks)
            await _idle(svc, "r")
            return refused

    refused = asyncio.run(main())
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "this service's model" in refused.message
    assert not decoded


def _nan_chunks(tiny, fmt: str) -> list:
    """All-NaN KV in `fmt`: native and bf16 carry NaN; fp8 NaN codes (0x7f) under finite scales;
    int8 codes are always finite, so finite values under a scale that overflows to inf on decode."""
    chunks = kvwire.chunks("nan", _run(tiny, RESERVED, fill=1.0 if fmt in ("fp8", "int8") else float("nan")), 0,
                           [], 4096, fmt, 16)
    for c in chunks:
        if fmt == "fp8":
            c.k = b"\x7f" * len(c.k)
        elif fmt == "int8":  # codes of 127 x a finite scale of 3e38 = inf
            c.scales = np.full(len(c.scales) // 4, 3e38, np.float32).tobytes()
        c.crc32 = kvwire.chunk_crc(c)
    return chunks


@pytest.mark.parametrize("fmt", ["native", "bf16", "fp8", "int8"])
def test_non_finite_kv_is_refused_and_never_reaches_the_prefix_cache(tiny, fmt):
    """All-NaN KV is refused; released with cache=True afterwards, nothing of its prompt is in
    the DRC: the next request with that prompt gets no cached tokens."""
    async def main():
        async with _main(tiny) as svc:
            p = await _reserve(svc, "nan")
            refused = await _refused(svc, _nan_chunks(tiny, fmt))
            await _idle(svc, "nan")
            await svc.Release(cluster_pb2.ReleaseRequest(request_id="nan", cache=True), Ctx())
            hit = await svc.worker.call(lambda e: e.prefix_hit(p))
            spec = cluster_pb2.SequenceSpec(request_id="next", prompt=p, max_tokens=MAX_TOKENS,
                                            sampling=rpc.sampling_to_pb(SamplingParams()))
            cached = (await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=True), Ctx())).cached_tokens
            return refused, hit, cached

    refused, hit, cached = asyncio.run(main())
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "not finite" in refused.message, refused.message
    assert (hit, cached) == (0, 0)


@pytest.mark.parametrize("error,code", [(MemoryError(), grpc.StatusCode.RESOURCE_EXHAUSTED),
                                        (RuntimeError("boom"), grpc.StatusCode.INTERNAL)])
def test_any_exception_while_decoding_fails_the_slot(tiny, monkeypatch, error, code):
    """The second chunk's decode raises: the push ends with a status, the reservation is failed
    (its Decode stream ends with that status) and its pages are back."""
    real, n = codec.decode, []

    def failing(*args):
        n.append(1)
        if len(n) == 2:
            raise error
        return real(*args)
    monkeypatch.setattr(codec, "decode", failing)

    async def main():
        async with _main(tiny) as svc:
            await _reserve(svc, "r")
            slot = svc.slots.get("r")
            refused = await _refused(svc, kvwire.chunks("r", _run(tiny, RESERVED), 0, [], 4096))
            await _idle(svc, "r")
            return refused, await asyncio.wait_for(slot.out.get(), 5)

    refused, ended = asyncio.run(main())
    assert refused.code == code and ended.code == code, (refused.code, ended)
    assert len(n) == 2


def test_a_chunk_naming_another_request_is_refused(tiny):
    """Chunk 1 of a stream opened for "a" names "b" (its checksum recomputed): refused, "a" is
    failed, "b" keeps its reservation and receives nothing."""
    first = kvwire.chunks("a", _run(tiny, RESERVED), 0, [], 4096)
    other = kvwire.chunks("b", _run(tiny, RESERVED), 0, [], 4096)
    assert len(first) > 2
    stream = [first[0], other[1], *first[2:]]

    async def main():
        async with _main(tiny) as svc:
            await _reserve(svc, "a")
            await _reserve(svc, "b", seed=1)
            refused = await _refused(svc, stream)
            await _idle(svc, "a")
            b = await svc.worker.call(lambda e: e.seqs["b"].pages.num_tokens)
            return refused, b, "b" in svc.slots

    refused, b_tokens, b_reserved = asyncio.run(main())
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "'b'" in refused.message, refused.message
    assert b_reserved and b_tokens == 0


@pytest.mark.parametrize("fmt,chunk_bytes,on_loop", [
    ("native", 4096, True),  # small raw copies: decoded where they arrive
    ("native+zstd", 4096, False),  # decompression: a worker thread
    ("native", 1 << 20, False),  # past kv_receiver.ON_LOOP_BYTES: a worker thread
])
def test_only_small_native_chunks_are_decoded_on_the_event_loop(tiny, monkeypatch, fmt, chunk_bytes, on_loop):
    from serving.engine import kv_receiver

    monkeypatch.setattr(kv_receiver, "ON_LOOP_BYTES", 8192)  # the 32 tokens' 16 KiB: past it in one chunk
    decoded = _record(monkeypatch, "decode")

    async def main():
        async with _main(tiny) as svc:
            await _reserve(svc, "r")
            chunks = kvwire.chunks("r", _run(tiny, RESERVED), 0, [], chunk_bytes, fmt)
            await svc.PushKV(_aiter(chunks), Ctx())
            return threading.current_thread(), await svc.worker.call(lambda e: e.seqs["r"].pages.num_tokens)

    loop_thread, imported = asyncio.run(main())
    assert imported == RESERVED and decoded
    assert all((t is loop_thread) == on_loop for _, t in decoded)


def test_a_malformed_chunk_mid_stream_fails_the_slot(tiny):
    """The gate refuses a chunk whose bytes do not parse (INVALID_ARGUMENT, raised through the
    stream's iterator as gate.MalformedRequest): the reservation the stream opened is failed too."""
    from serving import gate

    class AbortingCtx:
        code = None

        async def abort(self, code, message):
            self.code = code
            raise grpc.aio.AbortError()

    chunks = kvwire.chunks("r", _run(tiny, RESERVED), 0, [], 4096)
    malformed = gate._safe_parser(cluster_pb2.KVChunk)(b"\xff\xff")  # what the gate makes of bytes that do not parse
    assert isinstance(malformed, gate._Malformed)

    async def main():
        async with _main(tiny) as svc:
            await _reserve(svc, "r")
            slot, ctx = svc.slots.get("r"), AbortingCtx()
            with pytest.raises(gate.MalformedRequest) as refused:  # the gate aborts the call with it
                await asyncio.wait_for(svc.PushKV(gate._checked_iter(_aiter([chunks[0], malformed, *chunks[1:]]), ctx),
                                                  ctx), 30)
            await _idle(svc, "r")
            return refused.value.message, await asyncio.wait_for(slot.out.get(), 5)

    why, ended = asyncio.run(main())
    assert "not a valid KVChunk" in why
    assert ended.code == grpc.StatusCode.INVALID_ARGUMENT, ended
