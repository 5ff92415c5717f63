"""Tensor-parallel degrees that differ per role, through `pddjax up`: P's KV pool split over its
devices streams each shard's KV heads to an RLD and an MD of other degrees, and every pipeline
(pd-local, pd-cross, pdd) still gives the monolithic reference's tokens.

- tiny (4 query / 2 KV heads): P at TP=2 (KV heads split, one per device), RLD at TP=1, MD at
  TP=4 (2 KV heads < 4 devices: replicated): greedy and seeded, against the reference engine.
  (No tiny variant with 4 KV heads is servable: a stack takes a named config, a GGUF or an HF
  directory, and every tiny fixture has 2 KV heads; 4 -> 2 splits are covered in
  tests/kv/test_tensor_parallel.py.)
- SmolLM2-135M (9 / 3 heads): P and RLD at TP=3 (one KV head per device), MD at TP=1: HF's greedy
  tokens on the fixture prompts (real_model).

The services get 8 fake CPU devices through XLA_FLAGS in `pddjax up`'s environment (children
inherit it)."""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pytest

from pddjax.engines.reference import ReferenceEngine
from pddjax.model.sampling_params import SamplingParams
from serving.client import Client, make_request
from tests.support.paths import FIXTURES
from tests.support.serving_stack import UpProcess, launch_up
from tests.support.stack_checks import gauge

# cold jit cache: sharded step variants in three processes (tiny at 4 rows x 64 step tokens: 450 s loaded)
pytestmark = pytest.mark.timeout(900)

PIPELINES = ["pd-local", "pd-cross", "pdd"]
SEEDED = dict(temperature=0.9, top_k=40, top_p=0.95, seed=11)
# few step shapes (the real model: 14 per service), so a cold jit cache compiles little
ENGINE = {"dtype": "float32", "page_size": 16, "num_pages": 64, "max_step_tokens": 32, "max_rows": 2}


@contextlib.contextmanager
def fake_devices(n: int):
    """XLA_FLAGS for the processes started inside (restored after)."""
    old = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("XLA_FLAGS")
        else:
            os.environ["XLA_FLAGS"] = old


def up_stack(work, stack: dict, timeout: float) -> UpProcess:
    with fake_devices(8):
        return launch_up(work, stack, "--wan-latency-ms", "5", timeout=timeout)


@contextlib.contextmanager
def client_of(work, stack: dict, timeout: float):
    """-> (client, `pddjax up`'s state: services, log)."""
    up = up_stack(work, stack, timeout)
    try:
        c = Client(up.state["router"])
        try:
            yield c, up.state
        finally:
            c.close()
    finally:
        up.close()


def check_layouts(state: dict, lines: dict[str, str]) -> None:
    """Each receiving role logged the sender's degree and head split and its own pool's layout,
    and no engine service compiled anything after it reported SERVING (sharded KV copies included)."""
    with open(state["log"], errors="replace") as f:
        text = f.read()
    for role, line in lines.items():
        assert f"pddjax {role}: KV from a {line}" in text, (role, [x for x in text.splitlines() if "KV from" in x])
    for s in state["services"]:
        if s["role"] != "router":
            assert gauge(s["metrics"], "pddjax_jit_compiles_after_ready") == 0, s["role"]


TINY_STACK = {"model": "tiny", "platform": "cpu", "engine": ENGINE, "router": {"chunk_bytes": 4096},
              "prefill": {"tensor_parallel": 2}, "relay": {"tensor_parallel": 1}, "main": {"tensor_parallel": 4}}


@pytest.fixture(scope="module")
def tiny_client(tmp_path_factory):
    with client_of(tmp_path_factory.mktemp("tp-tiny"), TINY_STACK, timeout=600) as c_state:
        yield c_state


@pytest.mark.parametrize("sampling", [None, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_tiny_p2_rld1_md4_matches_reference(tiny_client, tiny, pipeline, sampling):
    tiny_client, state = tiny_client
    prompt = np.random.default_rng(len(pipeline) + (sampling is not None)).integers(3, 512, 70).tolist()
    r = tiny_client.generate(make_request(prompt, max_tokens=16, pipeline=pipeline, handoff="chunked",
                                          ignore_eos=True, **(sampling or {})), timeout=300)
    params = SamplingParams(**sampling) if sampling else SamplingParams()
    want = ReferenceEngine(tiny.config, tiny.weights).generate(prompt, params, 16, ()).token_ids
    assert r.pipeline == pipeline and r.token_ids == want, (r.sources, r.token_ids, want)
    if pipeline == "pd-cross":
        assert set(r.sources) == {"main"}  # every token from MD at TP=4, on P's TP=2 KV
    if pipeline == "pd-local":
        assert set(r.sources) == {"relay"}
    role = "relay" if pipeline == "pd-local" else "main"  # RLD at TP=1, MD at TP=4 (2 KV heads: replicated)
    check_layouts(state, {role: f"tensor_parallel 2 sender (heads [0, 1) [1, 2) per chunk) placed on "
                              f"{1 if role == 'relay' else 4} device(s) holding KV heads [0, 2)"})


REAL_STACK = {"model": "smollm2-135m", "platform": "cpu", "engine": ENGINE, "router": {"chunk_bytes": 1 << 20},
              "prefill": {"tensor_parallel": 3}, "relay": {"tensor_parallel": 3}, "main": {"tensor_parallel": 1}}


@pytest.mark.real_model
@pytest.mark.timeout(1800)  # cold, at 64 step tokens x 4 rows: 38 variants per service in ~780 s (loaded VM)
def test_real_model_p3_rld3_md1_matches_hf(tmp_path):
    with open(os.path.join(FIXTURES, "hf_smollm2.json")) as f:
        cases = json.load(f)["greedy"]
    with client_of(tmp_path, REAL_STACK, timeout=1500) as (c, state):
        for case, pipeline in zip(cases, PIPELINES * len(cases)):
            r = c.generate(make_request(case["prompt_ids"], max_tokens=12, pipeline=pipeline, handoff="chunked",
                                        ignore_eos=True), timeout=300)
            assert r.pipeline == pipeline and r.token_ids == case["token_ids"][:12], (case["name"], pipeline)
        split = "tensor_parallel 3 sender (heads [0, 1) [1, 2) [2, 3) per chunk) placed on"
        check_layouts(state, {"relay": f"{split} 3 device(s) holding KV heads [0, 1) [1, 2) [2, 3)",
                              "main": f"{split} 1 device(s) holding KV heads [0, 3)"})
