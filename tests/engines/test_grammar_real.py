"""On the real model (SmolLM2-135M, its GGUF tokenizer): a json_schema constrained greedy answer,
one short generation through the paged engine, is JSON that validates against the schema."""

import json

import pytest

from pddjax.engines.paged_engine import EngineConfig, PagedEngine
from pddjax.grammar.compiler import GrammarCompiler
from pddjax.grammar.spec import GrammarSpec
from pddjax.grammar.tokenizer import GrammarTokenizer
from pddjax.model.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "population"], "additionalProperties": False}


@pytest.mark.real_model
def test_a_json_schema_answer_of_the_real_model_validates(smollm):
    cfg, tok = smollm.config, smollm.tokenizer
    grammar = GrammarCompiler(GrammarTokenizer.of(tok, cfg.vocab_size, cfg.eos_token_ids))
    eng = PagedEngine(cfg, smollm.weights, smollm.fingerprint, EngineConfig(page_size=16, num_pages=64),
                      grammar=grammar)
    ids = tok.encode_chat([{"role": "user", "content": "Name a large city and its population, as JSON."}])
    eng.add("r", ids, SamplingParams(grammar=GrammarSpec.json_schema(SCHEMA)), 48)
    out = []
    while eng.has_work():
        out += eng.step()
        eng.check_integrity()
    assert out[-1].finish_reason == "stop"
    value = json.loads(tok.decode([ev.token for ev in out], skip_special=True))
    assert set(value) == {"city", "population"}, value
    assert isinstance(value["city"], str) and len(value["city"]) <= 16, value
    assert isinstance(value["population"], int) and value["population"] >= 0, value
