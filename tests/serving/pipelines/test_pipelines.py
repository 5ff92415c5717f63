"""Every pipeline end to end over loopback, each service its own process, tiny model:
tokens equal the monolithic reference's (greedy and seeded); a slowed A -> B link makes a
pdd request start on RLD and end on MD (one-shot and chunked handoff); a session's second
turn sends MD only the new suffix; foreign KV and bad requests are refused."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib

import grpc
import numpy as np
import pytest

from pddjax.kv.canonical import KVRun
from pddjax.model.sampling_params import SamplingParams
from serving.client import RouterError, make_request
from serving.kvwire import chunks
from serving.pb import cluster_pb2, cluster_pb2_grpc
from tests.support.samples import prompt
from tests.support.serving_stack import TINY_STACK
from tests.support.stack_checks import assert_idle, gauge

pytestmark = pytest.mark.timeout(400)  # a cold jit cache (CI) compiles in three processes

STACK = TINY_STACK  # the session's shared stack (tests/serving/conftest.py)
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, float32
EOS = (2,)
SEEDED = dict(temperature=0.9, top_k=40, top_p=0.95, seed=11)


def expected(ref, p, max_tokens, sampling):
    params = SamplingParams(**sampling) if sampling else SamplingParams()
    return ref.generate(p, params, max_tokens, EOS).token_ids


def check_sources(pipeline, sources):
    if pipeline == "pd-cross":
        assert set(sources) == {"main"}
    elif pipeline == "pd-local":
        assert set(sources) == {"relay"}
    else:  # relay first, then main, never back
        n = sources.count("relay")
        assert sources == ["relay"] * n + ["main"] * (len(sources) - n)


@pytest.mark.parametrize("sampling", [None, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("pipeline,handoff", [("pdd", "one-shot"), ("pdd", "chunked"), ("pd-cross", None),
                                              ("pd-local", None), ("auto", None)])
def test_pipeline_matches_reference(client, ref, stack, pipeline, handoff, sampling):
    seed = zlib.crc32(f"{pipeline}{handoff}{bool(sampling)}".encode()) % 1000  # stable across runs
    p = prompt(37 + seed % 50, seed)
    r = client.generate(make_request(p, max_tokens=24, pipeline=pipeline, handoff=handoff, **(sampling or {})),
                        timeout=240)
    assert r.token_ids == expected(ref, p, 24, sampling)
    assert len(r.sources) == len(r.token_ids) and r.pipeline != "auto"
    check_sources(r.pipeline, r.sources)
    assert r.usage["completion_tokens"] == len(r.token_ids) and r.ttft_ms > 0


@pytest.mark.parametrize("pipeline", ["pdd", "pd-cross"])
def test_long_prompt_streams_kv_while_prefilling(client, ref, stack, pipeline):
    """300 tokens with a 128-token step budget: P prefills in 3 steps and streams each step's
    KV before the next; receivers import piece by piece; tokens stay exact. In pdd RLD may write
    its 16 tokens before MD's KV has landed (the usage then has no bytes yet), so the bytes are
    read from the router's WAN counter once every service is idle again."""
    router = next(c for c in stack.children if c.role == "router").metrics
    assert_idle(stack, 60)
    before = gauge(router, "pddjax_router_wan_bytes_total")
    p = prompt(300, 60 if pipeline == "pdd" else 61)
    r = client.generate(make_request(p, max_tokens=16, pipeline=pipeline), timeout=240)
    assert r.token_ids == expected(ref, p, 16, None)
    whole = 300 * BYTES_PER_TOKEN
    assert r.usage["kv_bytes_to_main"] in ((0, whole) if pipeline == "pdd" else (whole,))
    assert_idle(stack, 60)
    assert gauge(router, "pddjax_router_wan_bytes_total") - before == whole


@pytest.mark.parametrize("handoff", ["one-shot", "chunked"])
def test_slow_link_pdd_starts_on_relay_ends_on_main(client, ref, stack, handoff):
    """120 prompt tokens = 61 KB of KV to MD; at 2 Mb/s that takes ~250 ms while RLD decodes
    up to 380 tokens (a few ms each here). A cold MD compiles each new extend shape (~1 s on
    this CPU), long enough for RLD to finish alone (correct, but no handoff to check), and MD
    takes the stream over only once it holds every token the user has, so RLD can finish first
    even after handing off: we retry with fresh prompts of the same shape until MD takes over
    (at most 6 tries). Chunked: RLD must also have had more than the threshold (48 tokens)
    pending when MD's KV landed, which a loaded machine's slower RLD may miss on one try."""
    stack.link.set(mbps=2.0)
    try:
        for attempt in range(6):
            p = prompt(120, 70 + attempt + (10 if handoff == "chunked" else 0))
            r = client.generate(make_request(p, max_tokens=380, pipeline="pdd", handoff=handoff, ignore_eos=True),
                                timeout=240)
            assert r.token_ids == ref.generate(p, SamplingParams(), 380, ()).token_ids
            check_sources("pdd", r.sources)
            if r.usage["main_tokens"] and (handoff == "one-shot" or r.usage["handoff_chunks"] >= 2):
                break
    finally:
        stack.link.set()
    print(handoff, attempt, r.usage, r.timings)
    assert r.sources[0] == "relay" and r.sources[-1] == "main", (r.usage, r.timings)
    assert r.timings["handoff_position"] == r.sources.index("main")
    if handoff == "chunked":  # RLD streamed on after its final: the stream moved once MD caught up
        assert r.timings["handoff_position"] >= r.usage["handoff_tokens"], (r.usage, r.timings)
    else:  # RLD paused for the one-shot final: the switch is where it stopped
        assert r.timings["handoff_position"] == r.usage["handoff_tokens"]
    if handoff == "chunked":  # RLD had more than the threshold (48) pending: several chunks
        assert r.usage["handoff_chunks"] >= 2, r.usage
    else:
        assert r.usage["handoff_chunks"] == 1


def test_second_turn_sends_main_only_the_new_suffix(client, ref, stack):
    p1 = prompt(100, 21)
    wan0 = stack.link.link.bytes_a_to_b
    r1 = client.generate(make_request(p1, max_tokens=40, pipeline="pdd", ignore_eos=True), timeout=240)
    wan1 = stack.link.link.bytes_a_to_b
    assert r1.usage["cached_on_main"] == 0 and r1.usage["kv_bytes_to_main"] == 100 * BYTES_PER_TOKEN
    p2 = p1 + r1.token_ids + prompt(20, 22)  # the next turn: whole context plus a new message
    r2 = client.generate(make_request(p2, max_tokens=8, pipeline="pdd", ignore_eos=True), timeout=240)
    wan2 = stack.link.link.bytes_a_to_b
    assert r2.token_ids == ref.generate(p2, SamplingParams(), 8, ()).token_ids
    # MD's DRC holds turn one's context (prompt + answer, full 16-token pages): only the rest crosses
    context = len(p1) + len(r1.token_ids) - 1  # the last sampled token's KV was never computed
    assert r2.usage["cached_on_main"] == context // 16 * 16
    delta = len(p2) - r2.usage["cached_on_main"]
    assert r2.usage["kv_bytes_to_main"] == delta * BYTES_PER_TOKEN
    full = len(p2) * BYTES_PER_TOKEN
    assert delta <= 20 + 16 and r2.usage["kv_bytes_to_main"] < full / 4
    # what crossed the link: the KV delta plus protocol overhead and the token handoff
    assert r2.usage["kv_bytes_to_main"] <= wan2 - wan1 < r2.usage["kv_bytes_to_main"] + 4096
    assert wan1 - wan0 >= r1.usage["kv_bytes_to_main"]
    print(f"turn 2: {wan2 - wan1} B over the WAN for {delta} new tokens; full KV {full} B; turn 1 {wan1 - wan0} B")


def test_foreign_fingerprint_is_refused(stack, tiny):
    md = cluster_pb2_grpc.DecodeStub(grpc.insecure_channel(stack.addr["main"]))
    p = prompt(20, 31)
    spec = cluster_pb2.SequenceSpec(request_id="foreign-1", prompt=p, max_tokens=4, stop_token_ids=[])
    md.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=True), timeout=10)
    k = np.ones((2, 20, 2, 16), np.float32)
    run = KVRun("some-other-model", 0, k, k, "float32")
    with pytest.raises(grpc.RpcError) as e:
        md.PushKV(iter(chunks("foreign-1", run, 0, [5], 4096)), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "some-other-model" in e.value.details()
    # never decoded: the reservation is gone and no token was produced
    with pytest.raises(grpc.RpcError) as e2:
        list(md.Decode(cluster_pb2.DecodeRequest(request_id="foreign-1"), timeout=10))
    assert e2.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


@pytest.mark.parametrize("kw,words", [
    (dict(prompt_ids=[]), "empty"),
    (dict(prompt_ids=[5, 900]), "vocabulary"),
    (dict(prompt_ids=[5, 6], max_tokens=0), "max_tokens"),
    (dict(prompt_ids=[5, 6], max_tokens=600), "context"),
    (dict(prompt_ids=[5, 6], top_p=1.5), "top-p"),
    (dict(prompt_ids=[5, 6], top_k=2**31), "top-k"),  # int32 on every step: used to wedge the engine
    (dict(prompt_ids=[5, 6], temperature=float("inf")), "temperature"),
    (dict(text="hello"), "tokenizer"),
])
def test_bad_requests_are_invalid_argument(client, kw, words):
    kw = {"max_tokens": 4, **kw}
    with pytest.raises(RouterError) as e:
        client.generate(make_request(**kw), timeout=10)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in str(e.value)


def test_generate_cli_through_the_router(stack, ref):
    p = prompt(30, 41)
    out = subprocess.run([sys.executable, "-m", "serving", "generate", "--router", stack.addr["router"], "--prompt-ids",
                          ",".join(map(str, p)), "--max-tokens", "10", "--pipeline", "pdd", "--handoff", "chunked",
                          "--json"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    j = json.loads(out.stdout)
    assert j["token_ids"] == expected(ref, p, 10, None) and j["pipeline"] == "pdd" and j["ttft_ms"] > 0
    assert len(j["sources"]) == len(j["token_ids"]) and j["sources"][0] == "relay"
    bad = subprocess.run([sys.executable, "-m", "serving", "generate", "--router", stack.addr["router"], "--prompt-ids",
                          "1,2,100000", "--json"], capture_output=True, text=True, timeout=240)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "INVALID_ARGUMENT" in bad.stderr


@pytest.mark.parametrize("pipeline", ["pdd", "pd-cross", "pd-local"])
def test_cancel_releases_every_tier(stack, client, ref, pipeline):
    """A client that goes away mid-stream: every tier drops the request; the next one is exact."""
    stack.link.set(mbps=2.0)
    try:
        call = client.stream(make_request(prompt(120, 90), max_tokens=380, pipeline=pipeline, ignore_eos=True),
                             timeout=240)
        got = 0
        for msg in call:
            got += len(msg.token_ids)
            if got >= 3:
                break
        call.cancel()
    finally:
        stack.link.set()
    assert_idle(stack)
    p = prompt(30, 91)
    assert client.generate(make_request(p, max_tokens=6, pipeline=pipeline), timeout=240).token_ids == \
        expected(ref, p, 6, None)




def test_nothing_left_in_flight(stack, client):
    """After everything above (including refusals), every tier holds no request and no page."""
    assert_idle(stack)


def test_duplicate_client_ids_never_interfere(client, ref, stack):
    """The client's request_id is a label (issue 17, defect 3): two concurrent requests with the
    same id both finish token-exact, and the id can be sent again at once."""
    import concurrent.futures

    ps = [prompt(30, 900 + i) for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda p: client.generate(make_request(p, max_tokens=8, pipeline="pdd",
                                                                       request_id="same-id"), timeout=60), ps[:2]))
    again = client.generate(make_request(ps[2], max_tokens=8, pipeline="pd-cross", request_id="same-id"), timeout=60)
    for p, r in zip(ps, [*results, again]):
        assert r.request_id == "same-id" and r.token_ids == expected(ref, p, 8, None)


@pytest.mark.parametrize("kw, words", [
    (dict(request_id="x" * 257), "request_id must be at most 256"),
    (dict(stop_strings=["a"] * 17), "at most 16 stop strings"),
    (dict(stop_strings=["a" * 257]), "at most 256 characters each"),
    (dict(stop_ids=list(range(65))), "at most 64 stop token ids"),
    (dict(prompt_ids=None, text="x" * ((1 << 20) + 1)), "characters; at most"),
    (dict(session_id="a\nb"), "session_id must be at most 256 printable"),
])
def test_public_inputs_are_bounded(client, kw, words):
    """Ids, stop strings and ids, and prompt text have stated bounds (issue 17, defect 4)."""
    with pytest.raises(RouterError) as e:
        client.generate(make_request(**{"prompt_ids": [5, 6], "max_tokens": 2, **kw}), timeout=10)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in str(e.value)
