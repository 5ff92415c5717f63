"""Constrained decoding through every pipeline, each service its own process, the tiny random
model as a chat model (a GGUF with a byte-level tokenizer): a json_schema, regex or Lark grammar
constrains every tier's tokens, P's first included; RLD hands MD token ids only and MD's
matcher, advanced through them, goes on from the same state. pd-local, pd-cross and pdd
(one-shot and chunked), greedy and seeded, give the monolithic reference's tokens under the
same grammar and the text parses against the schema; in pdd the A -> B link crawls until RLD
has streamed into the JSON's long string value, so the switch to MD falls inside the object.
(The OpenAI side, response_format and the SDK's parse: tests/serving/openai/test_api.py.)
"""

from __future__ import annotations

import json
import os
import re

import grpc
import pytest

from pddjax.engines.reference import ReferenceEngine
from pddjax.grammar.spec import GrammarSpec
from pddjax.model.registry import load_model
from pddjax.model.sampling_params import SamplingParams
from serving.client import Client, make_request
from serving.engine.grammars import compiler_for
from tests.support.chat_model import write_model
from tests.support.serving_stack import Stack
from tests.support.stack_checks import generate_switching_after

pytestmark = pytest.mark.timeout(400)

ENGINE = {"dtype": "float32", "page_size": 16, "num_pages": 256, "max_step_tokens": 128, "max_rows": 8}
NOTE = {"type": "object", "properties": {"note": {"type": "string", "minLength": 300, "maxLength": 350},
                                         "title": {"type": "string", "maxLength": 12},
                                         "count": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["note", "title", "count"], "additionalProperties": False}
SEEDED = dict(temperature=0.9, top_p=0.95, seed=5)


def make_stack(workdir: str) -> Stack:
    model = os.path.join(workdir, "tinychat.gguf")
    write_model(model, load_model("tiny"), max_context=2048)  # room for a tools preamble
    stack = Stack({"model": model, "platform": "cpu", "engine": ENGINE,
                   "router": {"chunk_bytes": 4096, "handoff_threshold": 48}}, workdir)
    stack.model_path = model
    return stack


@pytest.fixture(scope="module")
def chat_model(stack):
    return load_model(stack.model_path)


@pytest.fixture(scope="module")
def chat_ref(chat_model):
    return ReferenceEngine(chat_model.config, chat_model.weights, grammar=compiler_for(chat_model))


@pytest.fixture(scope="module")
def chat_client(stack):
    c = Client(stack.addr["router"])
    yield c
    c.close()


def check_note(text: str) -> dict:
    value = json.loads(text)
    assert set(value) == {"title", "note", "count"} and isinstance(value["count"], int), value
    assert len(value["title"]) <= 12 and 300 <= len(value["note"]) <= 350, value
    return value


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("pipeline,handoff", [("pdd", "one-shot"), ("pdd", "chunked"), ("pd-cross", None),
                                              ("pd-local", None)])
def test_a_json_schema_holds_on_every_pipeline_and_across_the_switch(stack, chat_client, chat_ref, chat_model,
                                                                      pipeline, handoff, sampling):
    asked = f"Write note {pipeline} {handoff} {bool(sampling)}."  # its own prompt: no cache hit on MD
    p = chat_model.tokenizer.encode_chat([{"role": "user", "content": asked}])
    spec = GrammarSpec.json_schema(NOTE)
    req = make_request(p, max_tokens=460, pipeline=pipeline, handoff=handoff, grammar=(spec.kind, spec.text),
                       **sampling)
    if pipeline == "pdd":
        r = generate_switching_after(stack, chat_client, req, 12)
    else:
        r = chat_client.generate(req, timeout=240)
    want = chat_ref.generate(p, SamplingParams(**sampling, grammar=spec), 460, tuple(chat_model.config.eos_token_ids))
    assert r.token_ids == want.token_ids and r.finish_reason == "stop", r.text
    check_note(r.text)
    if pipeline == "pdd":  # MD's KV arrives once RLD wrote 12 tokens: the note's value has begun
        assert r.sources[0] == "relay" and r.sources[-1] == "main", (r.usage, r.timings, r.total_ms)
        switch = len(chat_model.tokenizer.decode(r.token_ids[:r.sources.index("main")]))  # characters from RLD
        assert r.text.index('"note": "') + 9 < switch < len(r.text) - 1, (r.text, switch)  # inside the object


@pytest.mark.parametrize("pipeline", ["pdd", "pd-local"])
def test_a_regex_and_a_lark_grammar_constrain_the_text(chat_client, chat_ref, chat_model, pipeline):
    p = chat_model.tokenizer.encode("Codes:")
    for spec, pattern in ((GrammarSpec.regex(r"[A-Z]{3}-[0-9]{4}( [A-Z]{3}-[0-9]{4}){0,3}"),
                           r"[A-Z]{3}-[0-9]{4}( [A-Z]{3}-[0-9]{4}){0,3}"),
                          (GrammarSpec.lark('start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,3}/'),
                           r"yes|no|maybe [0-9]{1,3}")):
        r = chat_client.generate(make_request(p, max_tokens=60, pipeline=pipeline, grammar=(spec.kind, spec.text)),
                            timeout=120)
        assert re.fullmatch(pattern, r.text), r.text
        assert r.token_ids == chat_ref.generate(p, SamplingParams(grammar=spec), 60,
                                           tuple(chat_model.config.eos_token_ids)).token_ids


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}


def forced_grammar(chat_model, choice: str) -> GrammarSpec:
    """The grammar the router forces for this tool_choice (hermes: the tiny chat model's template has no tools)."""
    from serving.tool_calls.grammar import call_grammar
    from serving.tool_calls.validate import check_tools

    named = {"type": "function", "function": {"name": choice}} if choice not in ("required",) else choice
    kind, text = call_grammar("hermes", [WEATHER, TIME], check_tools([WEATHER, TIME], named, False),
                              chat_model.tokenizer.special_ids)
    return GrammarSpec(kind, text)


@pytest.mark.parametrize("pipeline,choice", [("pd-local", "required"), ("pd-cross", "get_weather"),
                                             ("pdd", "required"), ("pdd", "get_time")])
def test_a_required_tool_call_is_forced_parsed_and_exact_across_the_switch(stack, chat_client, chat_ref, chat_model,
                                                                            pipeline, choice):
    """tool_choice required / a named function: the grammar forces a call whose arguments
    validate against the tool's schema, the router parses it (finish_reason tool_calls), and the
    tokens equal the reference's under the same grammar; in pdd the switch falls inside the call.
    A call is ~100 tokens, which RLD on the tiny model writes in ~0.25 s: on a loaded machine MD's
    KV was still crossing, or MD still catching up, when the call ended. So pdd holds MD's KV only
    until RLD's first token and hands off one-shot (RLD pauses, MD goes on from its last token);
    the JSON-schema test above covers chunked under a grammar with a longer output."""
    chat = [{"role": "user", "content": f"Weather or time? ({pipeline} {choice})"}]
    req = make_request(chat=chat, max_tokens=300, pipeline=pipeline, tools=[WEATHER, TIME], tool_choice=choice,
                       parallel_tool_calls=False, handoff="one-shot" if pipeline == "pdd" else None,
                       **SEEDED)  # one call, then the grammar ends
    if pipeline == "pdd":
        r = generate_switching_after(stack, chat_client, req, 1)
        assert r.sources[0] == "relay" and r.sources[-1] == "main", (r.usage, r.timings)
    else:
        r = chat_client.generate(req, timeout=240)
    want = chat_ref.generate(r.prompt_ids, SamplingParams(**SEEDED, grammar=forced_grammar(chat_model, choice)), 300,
                             tuple(chat_model.config.eos_token_ids))
    assert r.token_ids == want.token_ids and r.finish_reason == "tool_calls", (r.text, r.finish_reason)
    assert len(r.tool_calls) == 1 and r.text.strip() == "", (r.text, r.tool_calls)
    for call in r.tool_calls:
        assert call["id"].startswith("call_") and call["name"] in (("get_weather", "get_time") if choice == "required"
                                                                     else (choice,))
        args = json.loads(call["arguments"])
        if call["name"] == "get_weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 40
        else:
            assert set(args) == {"zone"} and len(args["zone"]) <= 8


def test_tools_render_through_the_template_and_bad_tools_are_refused(chat_client, chat_model):
    """Tools and a tool turn reach the prompt (the Hermes preamble, the call, the tool's answer);
    malformed tools or messages are INVALID_ARGUMENT naming the part."""
    chat = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "4 C, rain"}]
    r = chat_client.generate(make_request(chat=chat, max_tokens=4, tools=[WEATHER], ignore_eos=True), timeout=120)
    prompt = chat_model.tokenizer.decode(r.prompt_ids)
    for part in ("<tools>", '"get_weather"', "<tool_call>", '"Oslo"', "<tool_response>", "4 C, rain"):
        assert part in prompt, (part, prompt)
    from serving.client import RouterError

    bad = [({"tools": [{"type": "retrieval"}]}, 'tools[0].type must be "function"'),
           ({"tools": [WEATHER], "tool_choice": "nothing_like_it"}, "tool_choice"),
           ({"tool_choice": "required"}, "needs tools")]
    for kw, words in bad:
        with pytest.raises(RouterError) as e:
            chat_client.generate(make_request(chat=chat[:1], max_tokens=4, **kw), timeout=60)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in str(e.value), str(e.value)
    orphan = [chat[0], {"role": "tool", "tool_call_id": "call_9", "content": "x"}]
    with pytest.raises(RouterError) as e:
        chat_client.generate(make_request(chat=orphan, max_tokens=4, tools=[WEATHER]), timeout=60)
    assert "answers no earlier assistant tool call" in str(e.value)


def test_nothing_compiles_after_serving_with_constrained_penalised_and_logprob_rows(stack, chat_client, chat_ref,
                                                                                     chat_model):
    """Last in this module, so every constrained request above counts too: constrained,
    penalised (with a logit bias) and logprob rows decoding side by side with plain ones, on
    every pipeline, build no step shape after SERVING on any engine service (the token mask and
    the penalty tables are arguments of every stated member, never a new variant)."""
    import concurrent.futures

    from tests.support.stack_checks import gauge

    spec = GrammarSpec.json_schema(NOTE)
    mixed = dict(presence_penalty=0.5, frequency_penalty=0.3, logit_bias={7: 2.0}, logprobs=True, top_logprobs=3)
    jobs = [(f"mix {i}", pipe, kw) for i, (pipe, kw) in enumerate([
        ("pdd", {"grammar": (spec.kind, spec.text)}), ("pd-local", mixed), ("pd-cross", {}),
        ("pdd", mixed), ("pd-local", {"grammar": (spec.kind, spec.text), **SEEDED}), ("pd-cross", mixed)])]

    def run(job):
        text, pipe, kw = job
        p = chat_model.tokenizer.encode_chat([{"role": "user", "content": text}])
        return chat_client.generate(make_request(p, max_tokens=60, pipeline=pipe, **kw), timeout=240)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # at once: the rows share steps
        results = list(pool.map(run, jobs))
    assert all(r.token_ids for r in results)
    assert all(len(r.logprobs) == len(r.token_ids) for r, (_, _, kw) in zip(results, jobs) if kw is mixed)
    import time

    time.sleep(1.0)  # the engine threads publish their gauges when idle
    for child in stack.children:
        if child.role != "router":
            assert gauge(child.metrics, "pddjax_jit_compiles") > 0, child.role
            assert gauge(child.metrics, "pddjax_jit_compiles_after_ready") == 0, child.role
