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

import pytest

from pddjax.engines.reference import ReferenceEngine
from pddjax.grammar.spec import GrammarSpec
from pddjax.model.registry import load_model
from pddjax.model.sampling_params import SamplingParams
from pddjax.wan.emulator import A_TO_B
from serving.client import Client, make_request
from serving.engine.grammars import compiler_for
from tests.support.chat_model import write_model
from tests.support.serving_stack import Stack

pytestmark = pytest.mark.timeout(400)

ENGINE = {"dtype": "float32", "page_size": 16, "num_pages": 256, "max_step_tokens": 128, "max_rows": 8}
NOTE = {"type": "object", "properties": {"note": {"type": "string", "minLength": 300, "maxLength": 350},
                                         "title": {"type": "string", "maxLength": 12},
                                         "count": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["note", "title", "count"], "additionalProperties": False}
SEEDED = dict(temperature=0.9, top_p=0.95, seed=5)


def make_stack(workdir: str) -> Stack:
    model = os.path.join(workdir, "tinychat.gguf")
    write_model(model, load_model("tiny"))
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


def generate_switching_after(stack, client, req, tokens: int):
    """Generate with MD's KV held on the A -> B link (blackholed: held, not lost) until RLD has
    streamed `tokens`: then it lands, and the stream moves to MD a few tokens later."""
    emulator, seen = stack.link.link.emulator, [0]

    def on_tokens(msg):
        seen[0] += len(msg.token_ids)
        if seen[0] >= tokens:
            emulator.clear_faults()

    emulator.inject(A_TO_B, blackhole=True)
    try:
        return client.generate(req, timeout=240, on_tokens=on_tokens)
    finally:
        emulator.clear_faults()


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
