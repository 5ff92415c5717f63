"""No compile while serving: a tiny-model stack (each engine precompiled its stated shape set
before SERVING) serves varied requests (every pipeline, short and chunked-prefill prompts,
concurrent decodes, RLD -> MD handoffs over a slowed link) and then every engine service's
`pddjax_jit_compiles_after_ready` is 0 (on the session's shared stack: counted over whatever
the modules before this one sent it too)."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from pddjax.model.sampling_params import SamplingParams
from serving.client import make_request
from tests.support.samples import prompt
from tests.support.serving_stack import TINY_STACK
from tests.support.stack_checks import gauge

pytestmark = pytest.mark.timeout(400)

STACK = TINY_STACK  # the session's shared stack (tests/serving/conftest.py)
SEED = 2000  # this module's prompts: prompt(n, SEED + i), drawn by no other module on the shared stack


def test_nothing_compiles_after_ready(stack, client, ref):
    mix = [(5, "pdd", None), (37, "pd-cross", None), (300, "pdd", "chunked"), (90, "pd-local", None),
           (150, "auto", None), (12, "pdd", "one-shot"), (64, "pd-cross", None), (200, "pd-local", None)]
    jobs = [(prompt(n, SEED + i), pipe, handoff, 8 + 5 * (i % 4)) for i, (n, pipe, handoff) in enumerate(mix)]

    def run(job):
        p, pipe, handoff, max_tokens = job
        r = client.generate(make_request(p, max_tokens=max_tokens, pipeline=pipe, handoff=handoff, ignore_eos=True),
                            timeout=240)
        assert r.token_ids == ref.generate(p, SamplingParams(), max_tokens, ()).token_ids, (pipe, len(p))
        return r

    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # concurrent: decode batches, extends join them
        list(pool.map(run, jobs))
    stack.link.set(mbps=2.0)  # KV to MD takes ~250 ms: pdd starts on RLD and hands its tokens to MD
    try:
        for attempt in range(6):  # RLD may finish alone before MD catches up: a fresh prompt, again
            r = client.generate(make_request(prompt(120, SEED + 90 + attempt), max_tokens=380, pipeline="pdd",
                                             handoff=("chunked", "one-shot")[attempt % 2], ignore_eos=True),
                                timeout=240)
            if r.usage["main_tokens"]:
                break
    finally:
        stack.link.set()
    assert r.usage["handoff_chunks"] and r.sources[-1] == "main", r.usage
    time.sleep(1.0)  # the engine threads publish their gauges when idle
    for child in stack.children:
        if child.role != "router":
            assert gauge(child.metrics, "pddjax_jit_compiles") > 0, child.role
            assert gauge(child.metrics, "pddjax_jit_compiles_after_ready") == 0, child.role
