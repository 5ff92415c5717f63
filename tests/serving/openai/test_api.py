"""The OpenAI-compatible gateway (serving/openai) against a real `pddjax up` stack, driven with
the official `openai` package.

The model is the tiny random model written as a GGUF with a byte-level tokenizer and a ChatML
template (so text prompts, chats and stop strings work at the tiny model's speed); the router
requires a bearer token (`--auth-token-file`), which is the API key; `max_inflight` 4 and
`max_queue` 0 make 429 reachable. One stack for the module. What is checked:
  - completions (token-id and text prompts) and chats, streamed and not, greedy and seeded,
    equal token for token (and in text) to the router's own gRPC answer to the same request;
  - usage: prompt / completion / total tokens, cached_tokens on a session's second turn (the
    session named by the `x-session-id` header; this stack opts in: PDDJAX_OPENAI_CACHE_HITS=1),
    the pddjax extension's relay/main split;
  - stop strings cut the text where the router cuts it (finish_reason stop);
  - errors in OpenAI's shape: 400 (ours and the router's), 401, 404, 429, 503 (router
    unreachable), 504 (deadline);
  - a client that disconnects mid-stream cancels the request: every tier idle, the router
    counts it CANCELLED;
  - /health, /v1/models, the gateway's metrics (on the router's metrics endpoint);
  - the gateway runs in the router's process (`pddjax up` co-hosts it), which loads no JAX.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pydantic
import pytest

from pddjax import env
from serving.client import Client, make_request
from serving.pb import cluster_pb2, cluster_pb2_grpc, router_pb2, router_pb2_grpc
from tests.support.chat_model import write_model
from tests.support.paths import ROOT
from tests.support.samples import prompt as ids
from tests.support.serving_stack import launch_up
from tests.support.stack_checks import scrape

pytestmark = pytest.mark.timeout(400)

TOKEN = "sk-pddjax-test-token"
ENGINE = {"dtype": "float32", "page_size": 16, "num_pages": 256, "max_step_tokens": 128, "max_rows": 8}
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 7}
WAN_MS = 1000  # one way, A -> B: a pd-cross request waits >= 1 s for its KV (in flight when a test acts)
CONFIG = os.path.join(ROOT, "configs", "tiny.toml")
LONG = 470  # tokens: ~0.8 s alone on the tiny model, more when 4 share the engine (still in flight when a test acts)


def start_up(request, d):
    """The `up` fixture's stack (tests/serving/conftest.py): the GGUF chat model, the bearer token."""
    model = str(d / "tinychat.gguf")
    write_model(model, request.getfixturevalue("tiny"), max_context=2048)  # room for a tools preamble
    (d / "token").write_text(TOKEN)
    stack = {"model": model, "platform": "cpu", "engine": ENGINE, "wan": {"mbps": 0, "latency_ms": WAN_MS},
             "router": {"chunk_bytes": 4096, "max_inflight": 4, "max_queue": 0}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(env.OPENAI_CACHE_HITS.name, "1")  # the operator's opt-in: cached_tokens told (one test reads them)
        u = launch_up(d, stack, "--auth-token-file", str(d / "token"))
    u.model_path = model
    return u


@pytest.fixture(scope="module")
def oai(up):
    c = openai.OpenAI(base_url=up.state["openai"], api_key=TOKEN, max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def router(up):
    c = Client(up.state["router"], token=TOKEN)
    yield c
    c.close()


# ---- helpers -------------------------------------------------------------------------------
def service(up, role):
    return next(s for s in up.state["services"] if s["role"] == role)


def gateway_count(up, endpoint, code) -> float:
    m = scrape(up.state["openai_service"]["metrics"])
    return m.get(("pddjax_openai_requests_total", (("code", str(code)), ("endpoint", endpoint))), 0.0)


def router_cancelled(up) -> float:
    m = scrape(service(up, "router")["metrics"])
    return sum(v for (name, labels), v in m.items()
               if name == "pddjax_router_failures_total" and ("code", "CANCELLED") in labels)


def wait_idle(up, timeout=30.0):
    """Every tier holds no request and no page, and the router admits nothing."""
    deadline = time.monotonic() + timeout
    while True:
        infos = {}
        for role in ("prefill", "relay", "main"):
            with grpc.insecure_channel(service(up, role)["address"]) as ch:
                stub = (cluster_pb2_grpc.PrefillStub if role == "prefill" else cluster_pb2_grpc.DecodeStub)(ch)
                infos[role] = stub.Info(cluster_pb2.InfoRequest(), timeout=10)
        with grpc.insecure_channel(up.state["router"]) as ch:
            st = json.loads(router_pb2_grpc.RouterStub(ch).Stats(
                router_pb2.StatsRequest(), timeout=10, metadata=[("authorization", f"Bearer {TOKEN}")]).json)
        busy = {r: (i.requests, i.pages_active) for r, i in infos.items() if i.requests or i.pages_active}
        if not busy and st["admission"]["inflight"] == 0:
            return
        assert time.monotonic() < deadline, (busy, st["admission"])
        time.sleep(0.2)


def streamed(stream) -> tuple[list[int], str, list]:
    """(token ids, text, chunks) of a streamed completion or chat."""
    toks, text, chunks = [], "", list(stream)
    for ch in chunks:
        for c in ch.choices:
            toks += getattr(c, "token_ids", None) or []
            text += (c.delta.content or "") if hasattr(c, "delta") else c.text
    return toks, text, chunks


# ---- the answers equal the router's ---------------------------------------------------------
def test_state_health_and_models(up, oai):
    assert up.state["openai"].startswith("http://127.0.0.1:") and up.state["openai"].endswith("/v1")
    router_pid = service(up, "router")["pid"]
    assert up.state["openai_service"]["pid"] == router_pid  # co-hosted: the gateway is the router's process
    with open(f"/proc/{router_pid}/maps") as f:
        assert "jaxlib" not in f.read()  # ... which still loads no JAX
    r = httpx.get(up.state["openai"].removesuffix("/v1") + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["router"] == "serving"
    models = oai.models.list().data
    assert [m.id for m in models] == ["tinychat"]
    assert models[0].pddjax["healthy_instances"] == {"prefill": 1, "relay": 1, "main": 1}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("prompt", ["ids", "text"])
def test_completion_equals_router(up, oai, router, stream, sampling, prompt):
    p = ids(30, 1) if prompt == "ids" else "Hello world, hello again."
    kw = dict(max_tokens=12, extra_body={"ignore_eos": True, "return_token_ids": True, "pipeline": "pdd"}, **sampling)
    want = router.generate(make_request(**({"prompt_ids": p} if prompt == "ids" else {"text": p}), max_tokens=12,
                                        pipeline="pdd", ignore_eos=True, top_p=sampling.get("top_p", 1.0),
                                        temperature=sampling["temperature"], seed=sampling.get("seed", 0)),
                           timeout=120)
    if stream:
        toks, text, chunks = streamed(oai.completions.create(model="tinychat", prompt=p, stream=True, **kw))
        last = chunks[-1]
        assert last.choices[0].finish_reason == "length" and last.pddjax["pipeline"] == "pdd"
        assert all(c.object == "text_completion" for c in chunks)
        ext = last.pddjax
    else:
        r = oai.completions.create(model="tinychat", prompt=p, **kw)
        toks, text = r.choices[0].token_ids, r.choices[0].text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(want.prompt_ids) and r.usage.completion_tokens == 12
        assert r.usage.total_tokens == len(want.prompt_ids) + 12
        assert r.prompt_token_ids == want.prompt_ids
        assert r.system_fingerprint == f"pddjax-{fingerprint(up)}"
        ext = r.pddjax
    assert toks == want.token_ids and text == want.text
    assert ext["relay_tokens"] + ext["main_tokens"] == 12 and ext["pipeline"] == "pdd"


def fingerprint(up) -> str:
    from pddjax.model.gguf_meta import file_fingerprint

    return file_fingerprint(up.model_path)


CHAT = [{"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "What is a lighthouse?"},
                                     {"type": "text", "text": "One line."}]},
        {"role": "assistant", "content": "A tower with a light."},
        {"role": "user", "content": "And a keeper?"}]
CHAT_AS_ROUTER = [CHAT[0], {"role": "user", "content": "What is a lighthouse?\nOne line."}, CHAT[2], CHAT[3]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, SEEDED], ids=["greedy", "seeded"])
def test_chat_equals_router(up, oai, router, stream, sampling):
    want = router.generate(make_request(chat=CHAT_AS_ROUTER, max_tokens=10, ignore_eos=True,
                                        temperature=sampling["temperature"], top_p=sampling.get("top_p", 1.0),
                                        seed=sampling.get("seed", 0)), timeout=120)
    kw = dict(model="tinychat", messages=CHAT, max_completion_tokens=10,
              extra_body={"ignore_eos": True, "return_token_ids": True}, **sampling)
    if stream:
        toks, text, chunks = streamed(oai.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                                  **kw))
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert all(c.usage is None for c in chunks[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].usage.prompt_tokens == len(want.prompt_ids)
    else:
        r = oai.chat.completions.create(**kw)
        toks, text = r.choices[0].token_ids, r.choices[0].message.content
        assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(want.prompt_ids) and r.prompt_token_ids == want.prompt_ids
    assert toks == want.token_ids and text == want.text


BIAS = {"5": 4.0, "40": -100.0}  # OpenAI's logit_bias: token ids as strings


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_and_penalties_equal_router(up, oai, router, stream):
    """logprobs / top_logprobs, presence / frequency penalties and logit_bias on a chat: the
    same tokens and logprobs as the router's gRPC answer; each token's text and UTF-8 bytes."""
    want = router.generate(make_request(chat=CHAT_AS_ROUTER, max_tokens=10, ignore_eos=True, temperature=0.8,
                                        top_p=0.95, seed=7, presence_penalty=0.5, frequency_penalty=0.3,
                                        logit_bias={5: 4.0, 40: -100.0}, logprobs=True, top_logprobs=3),
                           timeout=120)
    kw = dict(model="tinychat", messages=CHAT, max_completion_tokens=10, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True, "return_token_ids": True, "logit_bias": BIAS},
              presence_penalty=0.5, frequency_penalty=0.3, **SEEDED)
    if stream:
        toks, text, chunks = streamed(oai.chat.completions.create(stream=True, **kw))
        content = [c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
    else:
        r = oai.chat.completions.create(**kw)
        toks, text, content = r.choices[0].token_ids, r.choices[0].message.content, r.choices[0].logprobs.content
    assert toks == want.token_ids and text == want.text and 40 not in toks
    assert len(content) == len(toks) == len(want.logprobs)
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == text  # exact bytes: the text
    for c, (wlp, wtop) in zip(content, want.logprobs):
        assert len(c.top_logprobs) == 3 and all(a.bytes for a in c.top_logprobs)
        assert abs(c.logprob - wlp) < 1e-6
        assert all(abs(a.logprob - w) < 1e-6 for a, (_, w) in zip(c.top_logprobs, wtop))
        assert c.top_logprobs[0].logprob >= c.logprob - 1e-6  # the most likely first


def test_completion_logprobs_lists_align(up, oai, router):
    p = ids(25, 4)
    want = router.generate(make_request(p, max_tokens=8, pipeline="pdd", ignore_eos=True, logprobs=True,
                                        top_logprobs=2), timeout=120)
    r = oai.completions.create(model="tinychat", prompt=p, max_tokens=8, temperature=0, logprobs=2,
                               extra_body={"ignore_eos": True, "pipeline": "pdd"})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert all(abs(a - w) < 1e-6 for a, (w, _) in zip(lp.token_logprobs, want.logprobs))
    assert all(len(t) <= 2 and max(t.values()) >= v - 1e-6 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(8)]


@pytest.mark.parametrize("kw, param, words", [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs", "top_logprobs must be an integer in [0, 20]"),
    (dict(top_logprobs=2), "top_logprobs", "top_logprobs needs logprobs"),
    (dict(presence_penalty=3.0), "presence_penalty", "presence_penalty must be a number in [-2, 2]"),
    (dict(logit_bias={"abc": 1.0}), "logit_bias", "logit_bias key 'abc' is not a token id"),
    (dict(logit_bias={"3": 101.0}), "logit_bias", "logit_bias of token 3 must be a number in [-100, 100]"),
    (dict(extra_body={"repetition_penalty": 0.0}), "repetition_penalty", "repetition_penalty must be a number"),
])
def test_bad_sampling_values_are_400_naming_the_field(oai, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tinychat", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                    **kw)
    err = shape(e.value)
    assert err["param"] == param and words in err["message"], err


def test_a_logit_bias_past_the_vocabulary_is_the_routers_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tinychat", prompt=[5, 6], max_tokens=2, logit_bias={"100000": 1.0})
    assert "logit_bias token id 100000 is not a token id in [0, " in shape(e.value)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tinychat", prompt=[5, 6], max_tokens=2, logprobs=6)
    assert shape(e.value)["param"] == "logprobs"


class Note(pydantic.BaseModel):
    title: str = pydantic.Field(max_length=12)
    count: int


NOTE = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12},
                                         "count": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["title", "count"], "additionalProperties": False}


def test_structured_output(oai):
    """response_format json_object / json_schema, the SDK's parse with a pydantic model, and the
    regex (streamed) and Lark (a completion) extensions: the text is in the language asked."""
    kw = dict(model="tinychat", messages=[{"role": "user", "content": "A JSON note."}], max_tokens=200)
    r = oai.chat.completions.create(response_format={"type": "json_object"}, **{**kw, "max_tokens": 1200})
    text = r.choices[0].message.content  # any object: the random model may write one past max_tokens
    assert text.startswith("{") and (r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    r = oai.chat.completions.create(response_format={"type": "json_schema", "json_schema": {
        "name": "note", "schema": NOTE, "strict": True}}, **kw)
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"title", "count"} and len(value["title"]) <= 12 and 0 <= value["count"] <= 999, value
    parsed = oai.chat.completions.parse(response_format=Note, **kw).choices[0].message.parsed  # the SDK's schema
    assert isinstance(parsed, Note) and len(parsed.title) <= 12
    chunks = list(oai.chat.completions.create(stream=True, extra_body={"regex": "[0-9]{2}:[0-9]{2}"}, **kw))
    assert re.fullmatch("[0-9]{2}:[0-9]{2}", "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    c = oai.completions.create(model="tinychat", prompt="Answer:", max_tokens=20,
                               extra_body={"grammar": 'start: "red" | "green" | "blue"'})
    assert c.choices[0].text in ("red", "green", "blue")


@pytest.mark.parametrize("kw, param, words", [
    (dict(response_format={"type": "xml"}), "response_format", "response_format type must be text, json_object"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": []}}), "response_format",
     "must be an object with a `schema` object"),
    (dict(response_format={"type": "json_object"}, extra_body={"regex": "a+"}), "regex", "send one of"),
    (dict(extra_body={"regex": ""}), "regex", "regex"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "not": {"type": "string"}}}}), None, "not"),  # the grammar engine's sentence, via the router
    (dict(extra_body={"regex": "(unclosed"}), None, "regex"),
])
def test_bad_grammars_are_400_naming_the_part(oai, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tinychat", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                    **kw)
    err = e.value.response.json()["error"]
    assert err["param"] == param and words in err["message"], err


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "maximum": 999},
                                                                   "b": {"type": "integer", "maximum": 999}},
                                  "required": ["a", "b"], "additionalProperties": False}}}


def check_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f"), args
    else:
        assert name == "add" and set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values()), args
    return args


def test_tool_calls_whole_streamed_and_over_three_turns(oai):
    """tool_choice required (one call) and a named function: the call validates against its tool's
    schema (forced by a grammar, so even the random model calls correctly), finish_reason
    tool_calls; streamed as delta.tool_calls the SDK accumulates; then the tool's answers go back
    as "tool" messages for two more turns, the last one free to answer in text (auto)."""
    kw = dict(model="tinychat", tools=[WEATHER, ADD], max_tokens=300, parallel_tool_calls=False, **SEEDED)
    msgs = [{"role": "user", "content": "What is 2 + 3, and the weather in Oslo?"}]
    r = oai.chat.completions.create(messages=msgs, tool_choice="required", **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    check_call(call.function.name, call.function.arguments)
    chunks = list(oai.chat.completions.create(messages=msgs, stream=True,
                                              tool_choice={"type": "function", "function": {"name": "add"}}, **kw))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces and pieces[0].id.startswith("call_") and pieces[0].function.name == "add"
    check_call("add", "".join(p.function.arguments or "" for p in pieces))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    for turn in range(3):  # the agent loop: call, answer, call again or reply
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]})
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": "42" if call.function.name == "add"
                     else "4 C and rain"})
        r = oai.chat.completions.create(messages=msgs, tool_choice="required" if turn < 2 else "auto", **kw)
        m = r.choices[0].message
        if turn < 2:
            (call,) = m.tool_calls
            check_call(call.function.name, call.function.arguments)
        else:
            assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 300  # the tools preamble and two tool turns reached the template


def test_bad_tools_are_400_naming_the_part(oai):
    base = dict(model="tinychat", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    for kw, param, words in [
            (dict(tools=[{"type": "retrieval"}]), "tools", 'tools[0].type must be "function"'),
            (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
             "nope"),
            (dict(tool_choice="required"), "tool_choice", "needs tools"),
            (dict(messages=[{"role": "tool", "tool_call_id": "call_x", "content": "1"}]), "messages",
             "answers no earlier assistant tool call")]:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(**{**base, **kw})
        err = shape(e.value)
        assert err["param"] == param and words in err["message"], err


def test_n_choices_each_with_its_seed_sharing_the_prompt(oai, router):
    """n = 3: choice i is the router's answer with seed + i; usage counts the prompt once and
    every choice's tokens; streamed, the choices interleave by index and choices 1 and 2 find
    the prompt in P's prefix cache (its full pages shared, not prefilled three times)."""
    msgs = [{"role": "user", "content": "Three different short answers, please, about the sea and its tides."}]
    want = [router.generate(make_request(chat=msgs, max_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.95,
                                         seed=7 + i), timeout=120) for i in range(3)]
    kw = dict(model="tinychat", messages=msgs, max_tokens=8, n=3, extra_body={"ignore_eos": True}, **SEEDED)
    r = oai.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [w.text for w in want]
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(want[0].prompt_ids)
    chunks = list(oai.chat.completions.create(stream=True, **{**kw, "messages": [
        {"role": "user", "content": "Another three, about rivers and the rain that feeds them."}]}))
    texts, ends = {}, {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                ends[ch.index] = c.pddjax
    assert set(texts) == set(ends) == {0, 1, 2}
    assert ends[0]["cached_on_prefill"] == 0 and all(ends[i]["cached_on_prefill"] >= 16 for i in (1, 2)), ends


def test_second_turn_usage_and_cached_tokens(up, oai):
    """A session's two turns (named by the x-session-id header): turn 2 re-sends turn 1's prompt
    and answer; P's prefix cache supplies turn 1's prompt (cached_tokens, full 16-token pages),
    MD's DRC turn 1's prompt and answer."""
    p1 = ids(40, 2)
    kw = dict(model="tinychat", max_tokens=8, temperature=0, extra_headers={"x-session-id": "turns-1"},
              extra_body={"ignore_eos": True, "return_token_ids": True, "pipeline": "pd-cross"})
    r1 = oai.completions.create(prompt=p1, **kw)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0 and r1.pddjax["cached_on_main"] == 0
    p2 = p1 + r1.choices[0].token_ids + ids(10, 3)
    r2 = oai.completions.create(prompt=p2, **kw)
    assert r2.usage.prompt_tokens == len(p2) == 58 and r2.usage.completion_tokens == 8
    assert r2.usage.total_tokens == 66
    assert r2.usage.prompt_tokens_details.cached_tokens == 32  # 40 prompt tokens -> 2 full pages
    assert r2.pddjax["cached_on_prefill"] == 32
    assert r2.pddjax["cached_on_main"] == 32  # 40 + 8 - 1 known to MD -> 2 full pages (48 would be all 48)
    assert r2.pddjax["main_tokens"] == 8 and r2.pddjax["relay_tokens"] == 0


def test_stop_strings_cut_where_the_router_cuts(up, oai, router):
    prompt = "Tell me about the sea."
    full = oai.completions.create(model="tinychat", prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    k = next(i for i in range(6, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    stop = full[k:k + 2]
    want = router.generate(make_request(text=prompt, max_tokens=24, ignore_eos=True, stop_strings=[stop]),
                           timeout=120)
    for stream in (False, True):
        if stream:
            _, text, chunks = streamed(oai.completions.create(model="tinychat", prompt=prompt, max_tokens=24,
                                                              temperature=0, stop=stop, stream=True,
                                                              extra_body={"ignore_eos": True}))
            finish = chunks[-1].choices[0].finish_reason
        else:
            r = oai.completions.create(model="tinychat", prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                       extra_body={"ignore_eos": True})
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert text == full[:full.find(stop)] == want.text and finish == "stop", (stop, text, full)


# ---- errors ---------------------------------------------------------------------------------
def shape(e: openai.APIStatusError) -> dict:
    body = e.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("kw, param, words", [
    (dict(n=17), "n", "n must be in [1, 16]"),
    (dict(temperature=-1), "temperature", "greater than or equal to 0"),
    (dict(extra_body={"seed": -1}), "seed", "seed must be in"),
    (dict(extra_body={"stop_token_ids": [9999]}), None, "outside the vocabulary"),  # the router's sentence
    (dict(max_tokens=2100), None, "exceeds the model context of 2048"),  # the router's
    (dict(extra_body={"tools": [{"type": "function"}]}), "tools", "tools[0].function must be an object with a name"),
])
def test_bad_requests_are_400(oai, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tinychat", messages=[{"role": "user", "content": "hi"}],
                                    **{"max_tokens": 4, **kw})
    err = shape(e.value)
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error" and words in err["message"], err
    assert err["param"] == param


def test_wrong_or_missing_api_key_is_401_and_unknown_model_404(up, oai):
    bad = openai.OpenAI(base_url=up.state["openai"], api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="tinychat", prompt=[5, 6, 7], max_tokens=2)
    assert e.value.status_code == 401 and shape(e.value)["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(up.state["openai"] + "/completions", json={"model": "tinychat", "prompt": [5, 6], "max_tokens": 2},
                   timeout=30)  # no Authorization at all: the gateway does not add the token it could read
    assert r.status_code == 401 and "bearer token" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-4", prompt=[5, 6, 7], max_tokens=2)
    assert shape(e.value)["code"] == "model_not_found"


def test_past_the_routers_capacity_is_429_then_disconnects_free_every_tier(up, oai):
    """max_inflight 4, max_queue 0: with four pd-cross streams in flight (placed, their KV on the
    1 s WAN link) a fifth is refused 429; closing the four cancels them on every tier."""
    before = router_cancelled(up)
    gone = gateway_count(up, "chat", 499)
    streams = []
    try:
        for i in range(4):
            s = oai.chat.completions.create(model="tinychat", messages=[{"role": "user", "content": f"count {i}"}],
                                            max_tokens=LONG, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "pipeline": "pd-cross"})
            next(iter(s))  # the role chunk: the router admitted and placed it
            streams.append(s)
        with pytest.raises(openai.RateLimitError) as e:
            oai.chat.completions.create(model="tinychat", messages=[{"role": "user", "content": "one more"}],
                                        max_tokens=4)
        err = shape(e.value)
        assert e.value.status_code == 429 and "at capacity" in err["message"] and err["code"] == "rate_limit_exceeded"
    finally:
        for s in streams:
            s.close()
    wait_idle(up, timeout=30)
    assert router_cancelled(up) == before + 4
    deadline = time.monotonic() + 10
    while gateway_count(up, "chat", 499) < gone + 4:
        assert time.monotonic() < deadline, "the gateway did not count the 4 disconnects"
        time.sleep(0.1)


def test_deadline_is_504_and_frees_every_tier(up, oai):
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError) as e:
        oai.completions.create(model="tinychat", prompt=ids(20, 4), max_tokens=LONG, temperature=0,
                               extra_body={"ignore_eos": True, "request_timeout": 0.2, "pipeline": "pdd"})
    assert e.value.status_code == 504 and shape(e.value)["type"] == "timeout"
    assert time.monotonic() - t0 < 10
    wait_idle(up, timeout=30)


def test_router_unreachable_is_503(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    ready = str(tmp_path / "gw.json")
    proc = subprocess.Popen([sys.executable, "-m", "serving", "serve", "openai", "--router", dead, "--port", "0",
                             "--ready-file", ready], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(ready):
            assert proc.poll() is None and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.1)
        url = json.load(open(ready))["url"]
        assert httpx.get(url.removesuffix("/v1") + "/health", timeout=10).status_code == 503
        c = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.status_code == 503 and shape(e.value)["type"] == "service_unavailable"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_disconnect_mid_stream_cancels_on_every_tier(up, oai):
    before = router_cancelled(up)
    s = oai.completions.create(model="tinychat", prompt=ids(30, 5), max_tokens=LONG, temperature=0, stream=True,
                               extra_body={"ignore_eos": True, "pipeline": "pdd", "return_token_ids": True})
    got = []
    for ch in s:
        got += ch.choices[0].token_ids or []
        if len(got) >= 5:
            break
    s.close()
    wait_idle(up, timeout=30)
    assert router_cancelled(up) == before + 1  # cancelled, not finished
    assert len(got) < LONG


def test_metrics_count_requests_and_token_times(up):
    m = scrape(up.state["openai_service"]["metrics"])
    codes = {dict(labels)["code"] for (name, labels), v in m.items() if name == "pddjax_openai_requests_total" and v}
    assert {"200", "400", "401", "404", "429", "499", "504"} <= codes, codes
    for endpoint in ("chat", "completions"):
        assert m[("pddjax_openai_ttft_seconds_count", (("endpoint", endpoint),))] > 0
        assert m[("pddjax_openai_itl_seconds_count", (("endpoint", endpoint),))] > 0


def test_concurrent_streams_all_exact(up, oai, router):
    """Four concurrent streams (the router's max_inflight) each equal their own gRPC answer."""
    prompts = [ids(20 + 7 * i, 10 + i) for i in range(4)]
    want = [router.generate(make_request(p, max_tokens=16, ignore_eos=True), timeout=120).token_ids for p in prompts]

    def one(p):
        return streamed(oai.completions.create(model="tinychat", prompt=p, max_tokens=16, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True, "return_token_ids": True}))[0]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, prompts)) == want


def test_overhead_benchmarks_client_is_exact_and_reuses_its_connections(up, router):
    """tools/hostlab/openai_overhead.py's gateway side (aiohttp, keep-alive): 4 concurrent streams
    equal the router's answers, the first round opens one connection per stream and the second
    reuses them all (a timed round pays no connection setup)."""
    import asyncio

    from tools.hostlab.openai_overhead import connections, gateway

    prompts = [ids(24, 30 + i) for i in range(4)]
    want = [router.generate(make_request(p, max_tokens=8, ignore_eos=True, pipeline="pd-local"),
                            timeout=120).token_ids for p in prompts]

    async def rounds():
        async with connections(4, api_key=TOKEN) as (session, opened):
            first = await gateway(session, up.state["openai"], prompts, 8, "pd-local", model="tinychat")
            after_first = opened["tcp"]
            second = await gateway(session, up.state["openai"], prompts, 8, "pd-local", model="tinychat")
            return first, second, after_first, opened["tcp"]

    first, second, after_first, after_second = asyncio.run(rounds())
    assert [t.tokens for t in first] == want and [t.tokens for t in second] == want
    assert all(t.ttft is not None and t.router_ttft is not None and t.gateway_ttft is not None for t in second)
    assert (after_first, after_second) == (4, 4)



def test_serve_openai_flags_are_one_sentence(capsys):
    from serving.cli import main

    for args, words in ((["openai"], "needs --router"), (["openai", "--router", "127.0.0.1:1", "--host", "0.0.0.0"],
                                                           "refusing to serve the OpenAI gateway in plaintext"),
                        (["prefill"], "needs --config"),
                        (["prefill", "--config", CONFIG, "--openai-port", "0"], "--openai-port is for the router"),
                        (["router", "--config", CONFIG, "--openai-port", "0", "--openai-host", "0.0.0.0"],
                         "refusing to serve the OpenAI gateway in plaintext")):
        try:  # the command's own entry point, in this process (argparse's errors exit)
            code = main(["serve", *args])
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and words in err and err.count("\n") == 1, err


def test_the_gateway_never_forwards_api_keys_in_plaintext_off_host(monkeypatch):
    from serving import security
    from serving.openai.upstream import GrpcUpstream

    monkeypatch.delenv(security.TLS_DIR_ENV, raising=False)
    with pytest.raises(security.SecurityConfigError, match="in plaintext"):
        GrpcUpstream("10.1.2.3:50051")
    GrpcUpstream("127.0.0.1:50051")  # on the router's host: allowed
