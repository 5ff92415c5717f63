"""The real model (SmolLM2-135M) through `pddjax up`: every pipeline returns exactly the
monolithic float32 reference's tokens (greedy and seeded), pdd starting on RLD and ending on MD."""

from __future__ import annotations

import pytest

from pddjax.engines.reference import ReferenceEngine
from pddjax.model.sampling_params import SamplingParams
from serving.client import Client, make_request
from tests.support.serving_stack import launch_up

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(400)]

STACK = {"model": "smollm2-135m", "platform": "cpu",
         "engine": {"dtype": "float32", "page_size": 16, "num_pages": 64, "max_step_tokens": 64, "max_rows": 4},
         "router": {"handoff": "one-shot"}, "wan": {"latency_ms": 20}}
SEEDED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 7}
CASES = [  # (prompt, pipeline, handoff, sampling)
    ("The capital of France is", "pdd", "one-shot", None),
    ("def add(a, b):\n    return", "pdd", "chunked", SEEDED),
    ("Water boils at a temperature of", "pd-cross", None, None),
    ("Once upon a time, in a small village,", "pd-local", None, SEEDED),
    ("The three primary colors are", "auto", None, None),
]


def start_up(request, workdir):
    """The `up` fixture's stack (tests/serving/conftest.py)."""
    return launch_up(workdir, STACK)


@pytest.mark.parametrize("text,pipeline,handoff,sampling", CASES, ids=[f"{c[1]}-{c[2]}-{bool(c[3])}" for c in CASES])
def test_real_model_pipelines_match_reference(up, smollm, text, pipeline, handoff, sampling):
    c = Client(up.state["router"])
    try:
        p = smollm.tokenizer.encode(text)
        r = c.generate(make_request(p, max_tokens=12, pipeline=pipeline, handoff=handoff, ignore_eos=True,
                                    **(sampling or {})), timeout=240)
        params = SamplingParams(**sampling) if sampling else SamplingParams()
        want = ReferenceEngine(smollm.config, smollm.weights).generate(p, params, 12, ()).token_ids
        assert r.token_ids == want
        assert r.text == smollm.tokenizer.decode(want, skip_special=True)
        if pipeline == "pdd" and handoff == "one-shot":
            assert r.sources[0] == "relay" and r.sources[-1] == "main", r.sources
    finally:
        c.close()


FORECAST = {"type": "object", "additionalProperties": False, "required": ["city", "high_c", "sky"],
            "properties": {"city": {"type": "string", "maxLength": 24},
                           "high_c": {"type": "integer", "minimum": -60, "maximum": 60},
                           "sky": {"enum": ["sun", "cloud", "rain", "snow"]}}}


@pytest.mark.parametrize("pipeline,handoff", [("pdd", "one-shot"), ("pdd", "chunked"), ("pd-cross", None),
                                              ("pd-local", None)])
def test_real_model_json_schema_output_validates_and_matches_reference(up, smollm, pipeline, handoff):
    """The real model under a json_schema grammar: the answer parses and satisfies the schema, and
    its tokens are the reference's under the same grammar, in every pipeline (the grammar's state
    crosses the RLD -> MD switch in pdd)."""
    import json

    from pddjax.grammar.spec import GrammarSpec
    from serving.engine.grammars import compiler_for

    spec = GrammarSpec("json_schema", json.dumps(FORECAST))
    chat = [{"role": "user", "content": "Tomorrow's forecast for Paris, as JSON."}]
    c = Client(up.state["router"])
    try:
        r = c.generate(make_request(chat=chat, max_tokens=80, pipeline=pipeline, handoff=handoff,
                                    grammar=(spec.kind, spec.text)), timeout=240)
    finally:
        c.close()
    answer = json.loads(r.text)
    assert set(answer) == {"city", "high_c", "sky"} and isinstance(answer["city"], str), answer
    assert len(answer["city"]) <= 24 and -60 <= answer["high_c"] <= 60 and answer["sky"] in FORECAST[
        "properties"]["sky"]["enum"], answer
    ref = ReferenceEngine(smollm.config, smollm.weights, grammar=compiler_for(smollm))
    want = ref.generate(list(r.prompt_ids), SamplingParams(grammar=spec), 80, tuple(smollm.config.eos_token_ids))
    assert r.token_ids == want.token_ids
    if pipeline == "pdd" and handoff == "one-shot" and len(r.sources) > 4:
        assert r.sources[-1] == "main", r.sources
