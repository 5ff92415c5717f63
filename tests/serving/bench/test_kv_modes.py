"""`bench serve`'s compact-KV modes (issue 19) without a stack: `pdd-int8` (and any `pdd-FMT`) is
a default mode, parsed to the router's auto pipeline, configured with int8 on the WAN whatever
the base config's router says, kept out of the output-identity check, and reported (its figures,
the targets against pdd, the table); `bench handoff`'s per-format KV paths are parsed and tabled."""

from __future__ import annotations

import argparse
import json

import pytest

from pddjax.errors import UserError
from pddjax.model.config import NAMED_CONFIGS
from serving.bench.kv import handoff as bh
from serving.bench.serve import command as bs
from serving.bench.serve import figures as bf
from serving.config import service_config


def parse(*argv):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="bench")
    bs.register(sub)
    bh.register(sub)
    return p.parse_args(list(argv))


def test_wire_modes_parse_to_pdd_with_their_format():
    assert "pdd-int8" in parse("serve", "--json", "x").modes.split(",")  # a default mode
    assert bs.mode_pipeline("pdd-int8") == "auto" and bs.mode_pipeline("pdd-bf16+zstd") == "auto"
    assert bs.mode_pipeline("pd-cross") == "pd-cross" and bs.mode_pipeline("pdd-drc-off") == "auto"
    assert bs.mode_pipeline("pdd-int9") is None and bs.mode_pipeline("pd-int8") is None
    assert [bf.kv_wire_of(m) for m in ("pdd", "pdd-int8", "pdd-fp8+zstd", "pdd-drc-off", "pd-cross")] == \
        ["native", "int8", "fp8+zstd", "native", "native"]
    assert bf.exact("pdd-native+zstd") and bf.exact("pdd-drc-off") and not bf.exact("pdd-int8")
    with pytest.raises(UserError, match="unknown mode pdd-int9"):
        bs.run(parse("serve", "--json", "x", "--model", "tiny", "--modes", "pdd,pdd-int9"))


def test_the_int8_mode_puts_int8_on_the_wan_only(tmp_path):
    """The mode's format reaches the router as `[wan] kv_wire`; a base config's [router] kv_wire
    (which would win) does not leak into pdd or pdd-int8; the link itself ignores the key."""
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"router": {"kv_wire": "bf16", "relay_kv_wire": "bf16"}}))
    args = parse("serve", "--json", "x", "--model", "tiny", "--config", str(base))
    tiny = NAMED_CONFIGS["tiny"]
    for mode, want in (("pdd", "native"), ("pdd-int8", "int8"), ("pdd-fp8+zstd", "fp8+zstd")):
        stack = bs.stack_config(args, tiny, True, kv_wire=bf.kv_wire_of(mode))
        assert stack["wan"]["kv_wire"] == want and "kv_wire" not in stack["router"]
        router = service_config(stack, "router").router
        assert (router.kv_wire, router.relay_kv_wire) == (want, "bf16"), mode  # RLD's link keeps the base's
    from serving.stack.wanlink import WanLink

    link = WanLink.from_settings("127.0.0.1:1", bs.stack_config(args, tiny, True, kv_wire="int8")["wan"])
    assert link.mbps == args.wan_mbps


def rec(rid, toks, pipeline="pdd", relay=0, ttft=100.0, kv=0, prompt=100, cached=0):
    return bf.Record(rid, 0, 0, 0.9, prompt, pipeline=pipeline, ttft_ms=ttft, e2e_ms=ttft + 50, tpot_ms=10.0,
                     itl_ms=[10.0] * (len(toks) - 1), token_ids=toks, relay_tokens=relay,
                     main_tokens=len(toks) - relay, kv_bytes_to_main=kv, cached_on_main=cached)


def test_wire_mode_figures_targets_and_table_by_hand():
    """pdd (native) against pdd-int8 on hand-made records: bytes over the same requests, TTFT p99,
    RLD share; the lossy mode's outputs are compared, not required identical."""
    pdd = [rec("a", [1, 2, 3, 4], relay=4, ttft=900, kv=4_000_000, cached=60),  # 40 tokens MD lacked
           rec("b", [5, 6], relay=1, ttft=300, kv=0),  # P's transfer still running at the end
           rec("c", [7, 8], pipeline="pd-local", relay=2, ttft=200)]
    int8 = [rec("a", [1, 2, 9, 9], relay=1, ttft=500, kv=1_000_000, cached=60),
            rec("b", [5, 6], relay=0, ttft=400, kv=500_000, cached=80),
            rec("c", [7, 8], pipeline="pd-cross", kv=300_000, cached=60)]
    local = [rec("a", [1, 2, 3, 4], "pd-local", 4), rec("b", [5, 6], "pd-local", 2), rec("c", [7, 8], "pd-local", 2)]
    m = {"pdd": bf.mode_figures(pdd, 1.0, 9_000_000, 0),
         "pdd-int8": bf.mode_figures(int8, 1.0, 2_000_000, 0, kv_wire="int8"),
         "pd-local": bf.mode_figures(local, 1.0, 0, 0)}
    assert m["pdd"]["kv_wire"] == "native" and m["pdd-int8"]["kv_wire"] == "int8"
    assert m["pdd"]["kv_bytes_per_token_to_main"] == 100_000.0  # 4 MB / 40 tokens (b reported no transfer)
    assert m["pdd-int8"]["kv_bytes_per_token_to_main"] == 18_000.0  # 1.8 MB / (40 + 20 + 40) tokens
    assert m["pdd"]["rld_token_share"] == 0.875 and m["pdd"]["rld_token_share_pdd_requests"] == round(5 / 6, 4)
    assert m["pdd-int8"]["rld_token_share"] == 0.125 and m["pd-local"]["rld_token_share_pdd_requests"] is None
    per_mode = {"pdd": pdd, "pdd-int8": int8, "pd-local": local}
    t = bf.targets(m, per_mode)
    assert t["kv_bytes_pdd_over_pdd_int8"] == {"value": 4.0, "target": ">= 3.5", "met": True, "requests": 1}
    assert t["ttft_p99_pdd_int8_over_pdd"]["target"] == "< 1" and t["ttft_p99_pdd_int8_over_pdd"]["met"]
    assert t["rld_share_pdd_int8_vs_pdd"] == {"value": 0.125, "target": "< 0.875", "met": True}
    assert t["wan_bytes_pdd_over_pdd_int8"]["value"] == 4.5 and t["kv_bytes_to_main_pdd_over_pdd_int8"]["value"] == 2.22
    int8[0].kv_bytes_to_main, int8[0].ttft_ms = 1_500_000, 950  # 4 / 1.5 < 3.5; TTFT p99 above pdd's
    m["pdd-int8"] = bf.mode_figures(int8, 1.0, 2_000_000, 0, kv_wire="int8")
    t = bf.targets(m, per_mode)
    assert not t["kv_bytes_pdd_over_pdd_int8"]["met"] and not t["ttft_p99_pdd_int8_over_pdd"]["met"]
    bf16 = bf.targets({"pdd": m["pdd"], "pdd-bf16": {**m["pdd-int8"], "kv_wire": "bf16"}},
                      {"pdd": pdd, "pdd-bf16": int8})
    assert bf16["kv_bytes_pdd_over_pdd_bf16"]["target"] == "info"  # the 3.5x target is int8's / fp8's
    assert bf.kv_wire_targets({"pdd": m["pdd"], "pdd-drc-off": m["pdd"]}, {}) == {}  # DRC off is no wire mode
    assert bf.kv_wire_targets({"pdd-int8": m["pdd-int8"]}, per_mode) == {}  # nothing to compare against
    ident = bf.identity_check(per_mode)
    assert ident["identical"] and ident["compared"] == 3  # pd-local against pdd; pdd-int8 differs but is lossy
    assert ident["lossy"] == {"pdd-int8": {"against": "pdd", "compared": 3, "identical": 2, "first_diff_p50": 2.0}}
    assert not bf.identity_check({"pdd": pdd, "pdd-native+zstd": int8})["identical"]  # lossless: held to it
    table = bf.markdown({"modes": m, "targets": t, "outputs": ident})
    assert "| pdd-int8 | 3/3 |" in table and "| 2.0 | 2.3 int8 | 12.5% |" in table  # WAN MB, KV to MD, share
    assert "| 9.0 | 4.0 native | 87.5% |" in table
    assert "- kv_bytes_pdd_over_pdd_int8: 2.67 (target >= 3.5: MISSED)" in table
    assert "- outputs of pdd-int8 (lossy KV on the WAN) against pdd: 2 of 3 requests identical" in table


def test_handoff_kv_wire_formats_parse_and_table():
    assert parse("handoff").kv_wire.split(",") == ["native", "bf16", "int8", "fp8"]
    assert bh.wire_formats(" int8, native,int8 ") == ["int8", "native"]
    for bad in ("int9", ","):
        with pytest.raises(UserError, match="--kv-wire"):
            bh.wire_formats(bad)
    s = bh.summary([10.0, 30.0], [1.0, 3.0], 500)
    assert (s["mean_ms"], s["p50_ms"], s["max_ms"], s["encode_ms"], s["total_mean_ms"]) == (20.0, 20.0, 30.0, 2.0, 22.0)
    table = bh.wire_table({"native": {"handoff_kv": {"bytes": 1000}, "prompt_kv": {"bytes": 4000}},
                           "int8": {"handoff_kv": {"bytes": 260}, "prompt_kv": {"bytes": 1004}}})
    assert table["int8"]["bytes_over_native"] == {"handoff_kv": 0.26, "prompt_kv": 0.251}
    assert "bytes_over_native" not in bh.wire_table({"int8": {"handoff_kv": {"bytes": 1}}})["int8"]
