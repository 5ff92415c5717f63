"""`pddjax up --model DIR` serves a Hugging Face checkpoint end to end: the router tokenizes a chat
with the checkpoint's tokenizer and template (no JAX), P / RLD / MD load the safetensors, and a
pdd request's greedy tokens equal transformers' (qwen3 fixture: q/k norms, head_dim 32, tied)."""

from __future__ import annotations

import pytest

from serving.client import Client, make_request
from tests.support.paths import hf_fixture, hf_reference
from tests.support.serving_stack import launch_up

pytestmark = pytest.mark.timeout(480)  # a cold jit cache compiles 14 step variants in each of three processes

MODEL = hf_fixture("qwen3")


@pytest.fixture(scope="module")
def hf_ref():
    """transformers' answers on the qwen3 checkpoint."""
    return hf_reference("qwen3")


STACK = {"model": "tiny", "platform": "cpu",  # `--model DIR` overrides it
         "engine": {"dtype": "float32", "page_size": 16, "num_pages": 32, "max_step_tokens": 64, "max_rows": 4},
         "router": {"chunk_bytes": 4096}}


@pytest.fixture(scope="module")
def hf_client(tmp_path_factory):
    """A router client of `pddjax up --model` over the qwen3 checkpoint."""
    up = launch_up(tmp_path_factory.mktemp("up"), STACK, "--model", MODEL, "--wan-latency-ms", "5", timeout=400)
    try:
        c = Client(up.state["router"])
        yield c
        c.close()
    finally:
        up.close()


@pytest.mark.parametrize("pipeline", ["pdd", "pd-local"])
def test_chat_through_the_stack_equals_transformers(hf_client, hf_ref, pipeline):
    chat = next(p for p in hf_ref["prompts"] if p["name"] == "chat")
    r = hf_client.generate(make_request(chat=hf_ref["chat"]["messages"], max_tokens=hf_ref["n_new"],
                                        pipeline=pipeline, handoff="chunked", ignore_eos=True), timeout=240)
    assert r.pipeline == pipeline and r.usage["prompt_tokens"] == len(chat["prompt_ids"])
    assert r.token_ids == chat["greedy"]


def test_text_through_the_stack_equals_transformers(hf_client, hf_ref):
    fox = hf_ref["prompts"][0]
    r = hf_client.generate(make_request(text=fox["text"], max_tokens=hf_ref["n_new"], pipeline="pdd",
                                        ignore_eos=True), timeout=240)
    assert r.token_ids == fox["greedy"]
