"""Stream intervals end to end (tiny model, pd-local and pdd, each service its own process): at
1, 3 and 8 tokens a message the stream carries the reference's tokens and the same logprobs as at
1, only grouped differently (the first message at once with the first tokens ready, the middle ones
at least K tokens, the final one with finish and usage); the same through the OpenAI gateway's SSE;
bad values refused (INVALID_ARGUMENT / HTTP 400 naming the field) while a stream in flight goes on."""

from __future__ import annotations

import asyncio
import json
import threading

import grpc
import httpx
import pytest

from pddjax.model.sampling_params import SamplingParams
from serving.client import RouterError, make_request
from serving.openai.server import start_cohosted
from serving.openai.upstream import GrpcUpstream
from tests.support.samples import prompt
from tests.support.serving_stack import TINY_STACK
from tests.support.stack_checks import assert_idle, scrape

pytestmark = pytest.mark.timeout(400)

STACK = TINY_STACK  # the session's shared stack (tests/serving/conftest.py)
N = 40


def streamed(client, p, pipeline, k=None, ms=None, **kw):
    """-> (Result, the messages that carried tokens, the last message) of one stream at (k, ms)."""
    req = make_request(p, max_tokens=N, pipeline=pipeline, ignore_eos=True, **kw)
    if k is not None:
        req.stream_interval = k
    if ms is not None:
        req.stream_interval_ms = ms
    msgs = []
    r = client.generate(req, timeout=240, on_tokens=lambda m: msgs.append(m))
    return r, msgs


@pytest.mark.parametrize("pipeline", ["pd-local", "pdd"])
def test_intervals_group_the_same_tokens_and_logprobs(client, ref, stack, pipeline):
    p = prompt(45, 5 if pipeline == "pdd" else 6)
    want = ref.generate(p, SamplingParams(), N, ()).token_ids
    base, base_sizes = None, []
    for k in (1, 3, 8):
        r, msgs = streamed(client, p, pipeline, k, logprobs=True, top_logprobs=2)
        assert r.token_ids == want, k
        assert r.usage["completion_tokens"] == N and r.finish_reason == "length"
        base = base or r
        assert len(r.logprobs) == N
        for (a, ta), (b, tb) in zip(r.logprobs, base.logprobs):  # the same logprobs, grouped differently
            assert abs(a - b) < 1e-4 and [t for t, _ in ta] == [t for t, _ in tb]
        sizes = [len(m.token_ids) for m in msgs]
        print(pipeline, k, sizes)
        # the first message: the tokens ready, at once (usually 1; exactly 1 in test_stream_interval of router/)
        assert all(s >= k for s in sizes[1:-1])  # the middle ones hold K at least
        assert len(sizes) <= 2 + (N - sizes[0]) // k
        base_sizes = base_sizes or sizes
        assert k == 1 or len(sizes) < len(base_sizes)
    assert_idle(stack)


def test_rld_and_md_hold_the_tokens_so_the_router_reads_one_entry_per_k(client, ref, stack):
    """The interval is kept where the tokens are made: RLD's (pd-local) and MD's (pd-cross)
    DecodeStream entries for one request at K = 8 are its messages (the first, one per 8, the
    last), not one per engine step as at K = 1."""
    p = prompt(38, 7)
    want = ref.generate(p, SamplingParams(), N, ()).token_ids
    for pipeline, role in (("pd-local", "relay"), ("pd-cross", "main")):
        url = next(c.metrics for c in stack.children if c.role == role)
        sent = {}
        for k in (1, 8):
            before = scrape(url)[("pddjax_decode_stream_entries_total", ())]
            r, _ = streamed(client, p, pipeline, k)
            assert r.token_ids == want and set(r.sources) == {role}, (pipeline, k)
            sent[k] = scrape(url)[("pddjax_decode_stream_entries_total", ())] - before
        assert sent[8] <= 2 + N // 8 < N // 2 <= sent[1], (pipeline, sent)


def test_bad_values_are_refused_and_a_stream_in_flight_goes_on(client, ref):
    p = prompt(30, 9)
    done = {}
    t = threading.Thread(target=lambda: done.update(r=streamed(client, p, "pd-local", 3)[0]))
    t.start()
    for field, value in (("stream_interval", 0), ("stream_interval", 5000), ("stream_interval_ms", 70_000)):
        req = make_request(p, max_tokens=4)
        setattr(req, field, value)
        with pytest.raises(RouterError) as e:
            client.generate(req, timeout=60)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in str(e.value)
    t.join(240)
    assert done["r"].token_ids == ref.generate(p, SamplingParams(), N, ()).token_ids


def sse(stack, body):
    """-> (HTTP status, the `data:` payloads) of one /v1/completions POST through a gateway on the
    stack's router."""

    async def main():
        gw = await start_cohosted(GrpcUpstream(stack.addr["router"]), "127.0.0.1", 0, None)
        try:
            async with httpx.AsyncClient(base_url=f"http://{gw.address}", timeout=120) as c:
                async with c.stream("POST", "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        return resp.status_code, [(await resp.aread()).decode()]
                    lines = [x[6:] async for x in resp.aiter_lines() if x.startswith("data: ")]
                    return resp.status_code, lines
        finally:
            await gw.stop(0.5)

    return asyncio.run(main())


def test_the_gateways_sse_follows_the_routers_messages(stack, ref):
    p = prompt(33, 12)
    body = {"model": "tiny", "prompt": p, "max_tokens": N, "ignore_eos": True, "stream": True, "temperature": 0,
            "return_token_ids": True}
    want = ref.generate(p, SamplingParams(), N, ()).token_ids
    counts = {}
    for k in (1, 8):
        status, lines = sse(stack, {**body, "stream_interval": k, "pipeline": "pd-local"})
        assert status == 200 and lines[-1] == "[DONE]"
        chunks = [json.loads(x)["choices"][0] for x in lines[:-1] if json.loads(x).get("choices")]
        ids = [c.get("token_ids") or [] for c in chunks]
        assert [t for c in ids for t in c] == want
        sizes = [len(c) for c in ids if c]
        assert all(s >= k for s in sizes[1:-1]) and chunks[-1]["finish_reason"] == "length"
        counts[k] = len(sizes)
    assert counts[8] <= 2 + N // 8 < counts[1]
    for field, value in (("stream_interval", 0), ("stream_interval_ms", -1)):
        status, lines = sse(stack, {**body, field: value})
        assert status == 400 and field in json.loads(lines[0])["error"]["message"]
