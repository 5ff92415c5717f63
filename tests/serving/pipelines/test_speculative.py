"""Speculative decoding through the stack (`[engine] speculative = "ngram"`): pd-local, pd-cross
and pdd (RLD -> MD handoffs over a slowed link) give the monolithic reference's tokens, greedy
and seeded; a request may opt out (`GenerateRequest.speculative = false`); RLD and MD report
drafted / accepted tokens and compile nothing after SERVING."""

from __future__ import annotations

import time

import pytest

from pddjax.model.sampling_params import SamplingParams
from serving.client import make_request
from tests.support.samples import repetitive
from tests.support.stack_checks import gauge, generate_switching_after

pytestmark = pytest.mark.timeout(400)

STACK = {
    "model": "tiny", "platform": "cpu",
    "engine": {"dtype": "float32", "page_size": 16, "num_pages": 256, "max_step_tokens": 128, "max_rows": 8,
               "speculative": "ngram", "spec_max_tokens": 4},
    "router": {"chunk_bytes": 4096, "handoff_threshold": 48},
}
COOL = dict(temperature=0.2, top_k=40, top_p=0.95, seed=11)


def expected(ref, p, max_tokens, sampling):
    return ref.generate(p, SamplingParams(**(sampling or {})), max_tokens, ()).token_ids


@pytest.mark.parametrize("sampling", [None, COOL], ids=["greedy", "cool"])
@pytest.mark.parametrize("pipeline", ["pd-local", "pd-cross", "pdd"])
def test_speculating_pipelines_match_reference(client, ref, pipeline, sampling):
    p = repetitive(40 + len(pipeline), len(pipeline))
    r = client.generate(make_request(p, max_tokens=40, pipeline=pipeline, ignore_eos=True, **(sampling or {})),
                        timeout=240)
    assert r.token_ids == expected(ref, p, 40, sampling)


def test_handoff_under_speculation_matches_reference(client, ref, stack):
    """MD's KV is held on the A -> B link until RLD (drafting) has streamed 40 tokens, so the
    switch always happens, inside RLD's accepted runs; MD goes on drafting from the tokens."""
    for handoff in ("chunked", "one-shot"):
        p = repetitive(120, 90 + len(handoff))
        r = generate_switching_after(stack, client, make_request(p, max_tokens=300, pipeline="pdd", ignore_eos=True,
                                                                 handoff=handoff), 40)
        assert r.token_ids == expected(ref, p, 300, None)
        assert r.usage["handoff_chunks"] and r.sources[0] == "relay" and r.sources[-1] == "main", r.usage


def test_a_request_may_opt_out(client, ref):
    p = repetitive(50, 7)
    req = make_request(p, max_tokens=30, pipeline="pd-local", ignore_eos=True)
    req.speculative = False
    assert client.generate(req, timeout=240).token_ids == expected(ref, p, 30, None)


def test_decoders_report_drafts_and_compile_nothing_after_ready(client, stack):
    for pipeline in ("pd-local", "pd-cross"):  # RLD decodes the first, MD the second
        client.generate(make_request(repetitive(44, 3), max_tokens=30, pipeline=pipeline, ignore_eos=True),
                        timeout=240)
    time.sleep(1.0)  # the engine threads publish their gauges when idle
    roles = {child.role: child for child in stack.children}
    for role in ("relay", "main"):
        assert gauge(roles[role].metrics, "pddjax_spec_accepted_tokens") > 0, role
        assert gauge(roles[role].metrics, "pddjax_spec_drafted_tokens") >= \
            gauge(roles[role].metrics, "pddjax_spec_accepted_tokens")
    for child in stack.children:
        if child.role != "router":
            assert gauge(child.metrics, "pddjax_jit_compiles_after_ready") == 0, child.role
