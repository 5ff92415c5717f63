"""`bench serve --peer aiperf`: the trace as the peer's text load (the real model's tokenizer turns
every prompt back into the trace's ids: lengths, shared prefixes, a salt per run), AIPerf's input and
command line, the offline tokenizer's hub-cache layout, AIPerf's output read back (a recorded run
of AIPerf 0.13.0 against `pddjax up` with the real model: tests/fixtures/aiperf/), the comparison
and its 10% flags, the fake server's stream format. None of these needs AIPerf; the end-to-end test
runs it and is skipped where its venv (`peer_aiperf.default_venv()`) holds no AIPerf."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tomllib

import numpy as np
import pytest

from pddjax.workload import WorkloadConfig, generate
from serving.bench.serve import peer_aiperf, peer_compare, peer_load
from serving.bench.serve.replay import Record
from tests.support.paths import FIXTURES, ROOT

RECORDED = os.path.join(FIXTURES, "aiperf")


@pytest.fixture(scope="module")
def tokenizer():
    from pddjax.model.meta import model_facts

    return model_facts("smollm2-135m")[1]


@pytest.fixture(scope="module")
def words(tokenizer):
    return peer_load.WordMap(tokenizer)


def small_trace():
    cfg = WorkloadConfig(seed=3, duration_s=8.0, session_rate=0.5, turns_mean=3.0, turns_max=4, context_tokens=300,
                         output_median=6, output_sigma=0.5, output_max=12, n_docs=2, think_mean_s=0.2, warm_start_s=3.0)
    return generate(cfg)


def test_the_load_is_the_trace_as_text_the_tokenizer_turns_back_into_its_ids(words, tokenizer):
    trace = small_trace()
    history, measured = peer_load.build(trace, 3, words, salt=1)
    by_id = {r.request_id: r for r in trace}
    assert {it.request_id for it in history} == {r.request_id for r in trace if r.arrival_s < 0}
    assert {it.request_id for it in measured} == {r.request_id for r in trace if r.arrival_s >= 0}
    assert history and measured
    assert [it.at_ms for it in measured] == sorted(it.at_ms for it in measured)
    for it in history + measured:
        r = by_id[it.request_id]
        assert tokenizer.encode(it.text) == list(it.ids)  # what the gateway's tokenizer makes of it
        assert len(it.ids) == r.prompt_tokens and it.max_tokens == r.output_tokens
        assert it.at_ms == pytest.approx(1e3 * r.arrival_s, abs=1e-3)
        words.check(it)
    # shared prefixes as the trace states them: turn n's first prefix_tokens ids are turn n-1's sequence
    items = {it.request_id: it for it in history + measured}
    checked = 0
    for r in trace:
        prev = items.get(f"s{r.session_id}-t{r.turn - 1}")
        if r.turn and prev is not None:
            k = min(r.prefix_tokens, len(prev.ids))
            assert items[r.request_id].ids[:k] == prev.ids[:k]
            checked += k > 1
    assert checked
    # another salt: the same load but for its first id (no cached page carries over between runs)
    _, other = peer_load.build(trace, 3, words, salt=2)
    for a, b in zip(measured, other):
        assert a.ids[0] != b.ids[0] and a.ids[1:] == b.ids[1:] and a.at_ms == b.at_ms


def test_check_refuses_text_that_does_not_encode_back(words):
    it = peer_load.build(small_trace(), 3, words, salt=1)[1][0]
    glued = peer_load.LoadItem(it.request_id, it.session_id, it.turn, it.at_ms, it.ids, it.text.replace(" ", "", 1)
                               .replace(" ", "", 1), it.max_tokens)
    with pytest.raises(ValueError, match="does not encode back"):
        words.check(glued)


def test_aiperf_input_rows(tmp_path, words):
    _, measured = peer_load.build(small_trace(), 3, words, salt=1)
    path = str(tmp_path / "load.jsonl")
    peer_load.write_aiperf(measured, path)
    rows = peer_load.read_aiperf(path)
    assert [set(r) for r in rows] == [{"text", "timestamp", "output_length"}] * len(measured)
    assert [(r["text"], r["timestamp"], r["output_length"]) for r in rows] == \
        [(it.text, it.at_ms, it.max_tokens) for it in measured]


def test_command_line_and_the_pinned_requirement():
    cmd = peer_aiperf.command("aiperf", "http://127.0.0.1:8000/v1", "smollm2-135m", "pddjax/smollm2-135m", "in.jsonl",
                              "out", api_key="tok")
    s = " ".join(cmd)
    for part in ("--url http://127.0.0.1:8000 ", "--endpoint /v1/completions", "--endpoint-type completions",
                 "--streaming", "--custom-dataset-type single_turn", "--fixed-schedule", "ignore_eos:true",
                 "temperature:0", "--use-server-token-count", "--tokenizer pddjax/smollm2-135m", "--api-key tok"):
        assert part in s, part
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["peer"] == [peer_aiperf.REQUIREMENT]
    assert not any(d.startswith("aiperf") for d in extras["dev"])  # CI's install stays as it is
    env = peer_aiperf.environment("/h", "/w")
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HUB_CACHE"] == "/h"


def test_the_tokenizer_is_a_hub_cache_snapshot(tmp_path, tokenizer):
    from tokenizers import Tokenizer

    repo = peer_aiperf.write_tokenizer(tokenizer, "smollm2-135m", 8192, str(tmp_path))
    assert repo == "pddjax/smollm2-135m"
    root = tmp_path / "models--pddjax--smollm2-135m"
    commit = (root / "refs" / "main").read_text()
    snap = root / "snapshots" / commit
    cfg = json.loads((snap / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == tokenizer.token_text(tokenizer.eos_id) and cfg["model_max_length"] == 8192
    text = " the agentic trace, 2026"
    assert Tokenizer.from_file(str(snap / "tokenizer.json")).encode(text).ids == tokenizer.encode(text)


def test_recorded_aiperf_output_reads_back():
    recs = peer_aiperf.read_records(RECORDED)
    summary = peer_aiperf.read_summary(RECORDED)
    assert summary["version"] == "0.13.0" and summary["errors"] == 0
    assert len(recs) == summary["requests"] == 22 and all(r.error is None for r in recs)
    for r in recs:
        assert r.ttft_ms > 0 and r.output_tokens >= 1
        assert len(r.itl_message_ms) == r.output_tokens - 1  # the gateway streams one token a message
        if r.output_tokens > 1:  # AIPerf's "inter token latency" is vLLM's TPOT
            assert r.tpot_ms == pytest.approx((r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1), rel=1e-6)
            assert sum(r.itl_message_ms) == pytest.approx(r.e2e_ms - r.ttft_ms, rel=1e-6)
    ttft = np.array([r.ttft_ms for r in recs])
    # AIPerf's per-request percentiles are numpy's linear ones: its summary and our percentiles of its records agree
    assert summary["ttft_ms"]["p50"] == pytest.approx(float(np.percentile(ttft, 50)), rel=1e-9)
    assert summary["ttft_ms"]["p99"] == pytest.approx(float(np.percentile(ttft, 99)), rel=1e-9)
    mine = peer_compare.peer_records(recs)
    assert mine["tpot_ms"]["p50"] == pytest.approx(summary["tpot_ms"]["p50"], rel=1e-3)
    assert mine["itl_ms"]["n"] == sum(r.output_tokens - 1 for r in recs)


def _record(i, ttft, gaps):
    r = Record(f"s0-t{i}", 0, i, 0.0, 100)
    r.ttft_ms, r.itl_message_ms = ttft, list(gaps)
    r.e2e_ms = ttft + sum(gaps)
    r.tpot_ms = sum(gaps) / len(gaps) if gaps else math.nan
    r.token_ids = [7] * (len(gaps) + 1)
    return r


def test_compare_flags_what_is_beyond_ten_percent():
    our = peer_compare.ours([_record(i, 100.0 + 10 * i, [20.0] * 4) for i in range(5)])
    assert our["ttft_ms"]["p50"] == 120.0 and our["itl_ms"]["n"] == 20 and our["tpot_ms"]["p50"] == 20.0
    summary = {"ttft_ms": {"p50": 130.0, "p99": 150.0}, "itl_ms": {"p50": 22.5, "p99": 21.0},
               "tpot_ms": {"p50": None, "p99": None}}
    recs = {"tpot_ms": {"p50": 19.0, "p99": 25.0}}
    c = peer_compare.compare(our, summary, recs)
    f = c["figures"]
    assert f["ttft_ms"]["p50"]["ratio"] == round(130 / 120, 3) and f["ttft_ms"]["p50"]["within"]  # 8.3%
    assert f["itl_ms"]["p50"]["ratio"] == 1.125 and not f["itl_ms"]["p50"]["within"]  # 12.5%
    assert f["tpot_ms"]["p50"]["peer"] == 19.0  # the records' where the summary has none
    assert c["beyond"] == ["itl_ms p50", "tpot_ms p99"] and not c["agree"]
    table = peer_compare.markdown({"comparison": c, "ours": our, "peer": {"name": "aiperf", "records": {
        "requests": 5, "completed": 5, "output_tokens": 25}}})
    assert "1.125 (!)" in table and "no: itl_ms p50, tpot_ms p99" in table


def test_the_fake_server_streams_what_both_clients_read():
    from starlette.testclient import TestClient

    from serving.bench.serve import peer_fake

    with TestClient(peer_fake.make_app("m", 0.0, 0.0)) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == "m"
        r = c.post("/v1/completions", json={"model": "m", "prompt": " a b c", "max_tokens": 5, "stream": True,
                                             "return_token_ids": True, "stream_options": {"include_usage": True}})
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert len(tokens) == 5 and all(t["token_ids"] == [260] for t in tokens)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


@pytest.mark.real_model
@pytest.mark.skipif(not os.path.exists(peer_aiperf.executable(peer_aiperf.default_venv())),
                    reason="AIPerf is not installed in its venv (pddjax bench serve --peer aiperf creates it)")
def test_bench_serve_peer_end_to_end(tmp_path):
    """A short trace through `pddjax up` with the real model, ours then AIPerf: both complete every request."""
    from pddjax.workload import write_trace

    trace = tmp_path / "trace.jsonl"
    reqs = [r for r in small_trace() if r.session_id < 2]
    write_trace(str(trace), reqs, {"seed": 3})
    out = tmp_path / "peer.json"
    p = subprocess.run([sys.executable, "-m", "serving", "bench", "serve", "--trace", str(trace), "--json", str(out),
                        "--peer", "aiperf", "--peer-no-install", "--no-warmup"], capture_output=True, text=True,
                       timeout=580)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    n = sum(r.arrival_s >= 0 for r in reqs)
    assert res["ours"]["completed"] == res["peer"]["records"]["completed"] == n
    assert res["ours"]["output_tokens"] == res["peer"]["records"]["output_tokens"]
    assert set(res["comparison"]["figures"]) == {"ttft_ms", "itl_ms", "tpot_ms"}
