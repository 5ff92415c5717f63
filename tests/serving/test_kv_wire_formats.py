"""KV wire formats on the wire (issue 19): the chunk header names the format, the crc32 covers
the encoded bytes, a receiver refuses a format it did not declare, MD decodes each format into
its pool and decodes on (native token-exact), the router picks each target's format from the
config, and in a stack an int8 WAN transfer lands in MD with ~0.25x the bytes."""

from __future__ import annotations

import argparse
import asyncio

import grpc
import numpy as np
import pytest

from pddjax.engines.reference import ReferenceEngine
from pddjax.errors import UserError
from pddjax.kv import codec
from pddjax.model.sampling_params import SamplingParams
from serving import kvwire, rpc
from serving.config import service_config
from serving.engine.decode import DecodeService
from serving.pb import cluster_pb2
from serving.router.estimates import Estimates
from serving.router.pools import Instance
from tests.support.inprocess import Ctx, Refused, engine, prefill_runs
from tests.support.inprocess import aiter as _aiter
from tests.support.samples import prompt, run_of

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams()
TINY_NATIVE = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, float32


# ---- the chunk protocol ---------------------------------------------------------------------
def test_header_names_the_format_and_int8_chunks_are_cut_at_pages():
    run = run_of(60)
    ch = kvwire.Chunker("r", 5, 60, 2048, "int8", 16)
    pieces = ch.feed(run, [7])
    h = pieces[0].header
    assert h.kv_wire == "int8" and h.page_tokens == 16 and all(c.scales for c in pieces)
    assert [c.start for c in pieces][1:] and all(c.start % 16 == 0 for c in pieces[1:])  # one scale per page
    asm = kvwire.Assembler("fp")
    parts = [asm.feed(c) for c in pieces]
    k = np.concatenate([p.k for p in parts], axis=1)
    scale = np.abs(run.k[:, 5:]).max() / 127
    assert k.dtype == np.float32 and np.abs(k - run.k[:, 5:]).max() <= scale / 2 * (1 + 1e-5)
    sent = sum(len(c.k) + len(c.v) + len(c.scales) for c in pieces)
    assert asm.bytes == ch.bytes == sent and ch.native_bytes == 55 * 512 and sent < 0.3 * ch.native_bytes
    (native,) = kvwire.chunks("r", run, 0, [], 1 << 20)
    assert native.header.kv_wire == "native" and native.header.page_tokens == 0 and not native.scales


@pytest.mark.parametrize("fmt,field", [(f, x) for f in ("int8", "fp8+zstd", "bf16")
                                       for x in ("k", "v", "scales", "kv_wire", "page_tokens")
                                       if not (f == "bf16" and x == "scales")])  # bf16 has no scales
def test_crc_covers_the_encoded_bytes_and_the_format(fmt, field):
    pieces = kvwire.chunks("r", run_of(40), 0, [], 1 << 20, fmt, 16)
    c = pieces[0]
    if field in ("k", "v", "scales"):
        data = bytearray(getattr(c, field))
        data[len(data) // 2] ^= 1
        setattr(c, field, bytes(data))
    elif field == "kv_wire":
        c.header.kv_wire = {"int8": "fp8", "fp8+zstd": "int8+zstd", "bf16": "native"}[fmt]  # a size-compatible lie
    else:
        c.header.page_tokens ^= 8
    with pytest.raises(kvwire.WireError) as e:
        kvwire.Assembler("fp").feed(c)
    assert e.value.code_name == "DATA_LOSS" and "checksum" in str(e.value)


def test_small_native_chunks_decode_on_the_loop_and_the_rest_on_a_thread():
    """The receiver decodes a native chunk of at most ON_LOOP_BYTES on its event loop; a larger
    one, or one of a lossy format (decompression), on a worker thread."""
    from serving.engine import kv_receiver

    def first_chunk(fmt: str, tokens: int):
        return kvwire.Chunker("r", 0, tokens, 1 << 30, fmt, 16).feed(run_of(tokens), [7])[0]

    fits = kv_receiver.ON_LOOP_BYTES // TINY_NATIVE  # tokens of tiny KV in a chunk that fits
    fresh = kvwire.Assembler(run_of(1).fingerprint)
    assert kv_receiver._on_loop(fresh, first_chunk("native", fits))
    assert not kv_receiver._on_loop(fresh, first_chunk("native", fits + 1))
    assert not kv_receiver._on_loop(fresh, first_chunk("int8", 16))
    opened = kvwire.Assembler(run_of(1).fingerprint, accepts=("native", "int8"))
    opened.feed(first_chunk("int8", 16))  # the stream's format, named by its first chunk
    later = first_chunk("native", 16)
    later.ClearField("header")
    assert not kv_receiver._on_loop(opened, later)


def test_assembler_refuses_a_format_it_did_not_declare():
    (c,) = kvwire.chunks("r", run_of(20), 0, [], 1 << 20, "int8", 16)
    with pytest.raises(kvwire.WireError) as e:
        kvwire.Assembler("fp", accepts=("native", "bf16")).feed(c)
    assert e.value.code_name == "INVALID_ARGUMENT"
    assert "'int8'" in str(e.value) and "declared (native, bf16)" in str(e.value)
    kvwire.Assembler("fp", accepts=("native", "int8")).feed(c)  # declared: accepted


# ---- MD in process: decode each format into the pool and decode on -----------------------------
def test_main_imports_every_format_and_decodes_native_exactly(tiny):
    """One MD (the real DecodeService, tiny model): a prompt's KV pushed in each format with P's
    first token; native's tokens equal the reference's, the lossy ones run to max_tokens; a
    receiver that declared native only refuses int8 with INVALID_ARGUMENT and drops it."""
    formats = ("native", "bf16", "int8", "fp8", "int8+zstd")
    prompts = {f: prompt(40, 10) for f in formats} | {"refused": prompt(40, 11)}
    runs = prefill_runs(tiny, prompts, GREEDY)
    want = ReferenceEngine(tiny.config, tiny.weights).generate(prompts["native"], GREEDY, 12, ()).token_ids

    async def main():
        svc = DecodeService("main", engine(tiny), tiny.config, {"role": rpc.ROLE_NAMES["main"]})
        svc.start(asyncio.get_running_loop())
        out: dict = {}
        try:
            info = await svc.Info(cluster_pb2.InfoRequest(), Ctx())
            for rid, p in prompts.items():
                spec = cluster_pb2.SequenceSpec(request_id=rid, prompt=p, sampling=rpc.sampling_to_pb(GREEDY),
                                                max_tokens=12)
                await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=False), Ctx())
            slots = {}
            for f in formats:
                await svc.PushKV(_aiter(kvwire.chunks(f, runs[f], 0, [want[0]], 4096, f, 16)), Ctx())
                slots[f] = svc.slots.get(f)  # a slot leaves svc.slots once its stream is closed
            svc.kv.accepts = ("native",)
            with pytest.raises(Refused) as refused:
                await svc.PushKV(_aiter(kvwire.chunks("refused", runs["refused"], 0, [want[0]], 4096, "int8", 16)),
                                 Ctx())
            for f in formats:
                slot, out[f] = slots[f], []
                while True:
                    batch = await asyncio.wait_for(slot.out.get(), 60)
                    out[f] += list(batch.token_ids)
                    if batch.finish_reason:
                        break
            return info, refused.value, out, "refused" in svc.slots
        finally:
            svc.worker.stop()

    info, refused, out, still_reserved = asyncio.run(main())
    assert list(info.kv_wire_formats) == list(codec.FORMATS)
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and "'int8'" in refused.message, refused.message
    assert not still_reserved  # refused KV is never decoded
    assert out["native"] == want
    for f in formats:
        assert len(out[f]) == 12 and out[f][0] == want[0], (f, out[f])
    print({f: sum(a == b for a, b in zip(out[f], want)) for f in formats})


# ---- the router's choice per target --------------------------------------------------------------
def _instance(role, formats, layers=30, heads=3, dim=64):
    i = Instance(role, f"{role}:1")
    i.info = cluster_pb2.ServiceInfo(num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype="float32",
                                     page_size=16, kv_wire_formats=formats)
    return i


def test_router_picks_each_targets_format_from_the_config():
    s = service_config({"wan": {"kv_wire": "int8"}, "router": {"relay_kv_wire": "bf16"}}, "router").router
    assert (s.kv_wire, s.relay_kv_wire) == ("int8", "bf16")
    assert service_config({"wan": {"kv_wire": "int8"}, "router": {"kv_wire": "fp8"}}, "router").router.kv_wire == "fp8"
    assert service_config({}, "router").router.kv_wire == "native"
    for bad in ({"wan": {"kv_wire": "int4"}}, {"router": {"relay_kv_wire": "lz4"}}):
        with pytest.raises(UserError, match="kv_wire must be one of"):
            service_config(bad, "router")
    est = Estimates(s)
    prefill = _instance("prefill", [])

    async def main():
        return (await est.wire_format(_instance("main", codec.FORMATS)),
                await est.wire_format(_instance("relay", codec.FORMATS)),
                await est.wire_format(_instance("main", ["native", "bf16"])),  # did not declare int8
                await est.wire_bytes_per_token(prefill, "int8"), await est.wire_bytes_per_token(prefill, "native"))

    main_fmt, relay_fmt, fallback, int8_bytes, native_bytes = asyncio.run(main())
    assert (main_fmt, relay_fmt, fallback) == ("int8", "bf16", "native")
    assert native_bytes == 46_080 and int8_bytes == pytest.approx(46_080 * 0.251, rel=1e-3)
    # transfers refine a format's ratio (zstd's depends on the KV)
    est.ratio("int8+zstd", prefill.info)
    est.learn_wire("int8+zstd", cluster_pb2.TransferDone(bytes=200_000, native_bytes=1_000_000))
    assert est.wire_ratio["int8+zstd"].value == pytest.approx(0.2)
    assert est.stats()["kv_wire"]["main"] == "int8"


def test_up_flag_sets_the_wan_format():
    from serving.cli.serve import load_stack

    args = argparse.Namespace(config=None, model="tiny", dtype=None, wan_mbps=None, wan_latency_ms=None,
                              wan_capacity_mbps=None, kv_wire="int8+zstd")
    stack = load_stack(args)
    assert stack["wan"]["kv_wire"] == "int8+zstd"
    assert service_config(stack, "router").router.kv_wire == "int8+zstd"
    with pytest.raises(UserError, match="kv_wire"):
        load_stack(argparse.Namespace(**{**vars(args), "kv_wire": "int3"}))


# ---- a stack: int8 over the WAN -------------------------------------------------------------------
# a router of these settings (and its own link) over the session's shared tiny engines: the format
# is the router's choice per target, the engines take any; prompts drawn by no other user of them
ROUTER = {"router": {"chunk_bytes": 4096, "relay_kv_wire": "bf16"}, "wan": {"kv_wire": "int8"}}


def test_int8_wan_transfer_lands_in_main_and_decoding_proceeds(tiny_stack):
    from serving.client import Client, make_request
    from tests.support.serving_stack import Router

    stack = Router(tiny_stack, ROUTER)
    client = Client(stack.addr["router"])
    try:
        p = prompt(64, 50)  # 4 pages
        wan0 = stack.link.link.bytes_a_to_b
        cross = client.generate(make_request(p, max_tokens=10, pipeline="pd-cross", ignore_eos=True), timeout=240)
        wan1 = stack.link.link.bytes_a_to_b
        int8 = codec.encode(np.zeros((2, 64, 2, 16), np.float32), np.zeros((2, 64, 2, 16), np.float32), 0, "int8", 16)
        assert cross.usage["kv_bytes_to_main"] == int8.nbytes == 64 * 128 + 4 * 2 * 2 * 2 * 4  # values + scales
        assert cross.usage["kv_bytes_to_main"] <= wan1 - wan0 < cross.usage["kv_bytes_to_main"] + 4096
        assert cross.usage["kv_bytes_to_main"] < 0.26 * 64 * TINY_NATIVE
        assert len(cross.token_ids) == 10 and set(cross.sources) == {"main"} and "KV wire MD int8" in cross.explain
        local = client.generate(make_request(prompt(40, 51), max_tokens=6, pipeline="pd-local", ignore_eos=True),
                                timeout=240)
        assert local.usage["kv_bytes_to_relay"] == 40 * TINY_NATIVE // 2 and "KV wire RLD bf16" in local.explain
        pdd = client.generate(make_request(prompt(48, 52), max_tokens=24, pipeline="pdd", ignore_eos=True),
                              timeout=240)
        assert len(pdd.token_ids) == 24 and pdd.usage["kv_bytes_to_main"] < 0.26 * 48 * TINY_NATIVE
        assert "KV wire RLD bf16, MD int8" in pdd.explain
    finally:
        client.close()
        stack.close()
