"""The real model (SmolLM2-135M) through `pddjax up`: a pdd request on a short prompt returns
exactly the monolithic float32 reference's tokens, starting on RLD and ending on MD."""

from __future__ import annotations

import json

import pytest

from pddjax.engines.reference import ReferenceEngine
from pddjax.model.sampling import SamplingParams
from pddjax.serving.client import Client, make_request
from tests.serving_stack import UpProcess

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]

STACK = {"model": "smollm2-135m", "platform": "cpu",
         "engine": {"dtype": "float32", "page_size": 16, "num_pages": 48, "max_step_tokens": 64, "max_rows": 4},
         "router": {"handoff": "one-shot"}, "wan": {"latency_ms": 20}}


def test_real_model_pdd_matches_reference(tmp_path, smollm):
    cfg = tmp_path / "stack.json"
    cfg.write_text(json.dumps(STACK))
    up = UpProcess(["--config", str(cfg), "--port", "0"], str(tmp_path / "state.json"), timeout=240)
    try:
        c = Client(up.state["router"])
        p = smollm.tokenizer.encode("The capital of France is")
        r = c.generate(make_request(p, max_tokens=12, pipeline="pdd", ignore_eos=True), timeout=120)
        want = ReferenceEngine(smollm.config, smollm.weights).generate(p, SamplingParams(), 12, ()).token_ids
        assert r.token_ids == want
        assert r.sources[0] == "relay" and r.sources[-1] == "main", r.sources
        assert r.text == smollm.tokenizer.decode(want, skip_special=True)
        c.close()
    finally:
        up.close()
