"""Penalties, logit_bias and logprobs through every pipeline, each service its own process,
tiny model: the tokens and the logprobs (the sampled token's and the top alternatives') equal
the monolithic reference's, whichever tier sampled each position: P the first token, RLD the
next, MD the rest after the switch (its penalty counts rebuilt from the handed-over token ids).
Out-of-range values are refused by name before anything runs."""

from __future__ import annotations

import zlib

import grpc
import pytest

from pddjax.model.sampling_params import SamplingParams
from serving.client import RouterError, make_request
from tests.support.samples import prompt
from tests.support.serving_stack import TINY_STACK

pytestmark = pytest.mark.timeout(400)

STACK = TINY_STACK  # the session's shared stack (tests/serving/conftest.py)
EOS = (2,)
FEATURES = dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3,
                logit_bias={5: 3.0, 17: -100.0, 300: 1.5}, logprobs=True, top_logprobs=5)
SEEDED = dict(temperature=0.9, top_k=40, top_p=0.95, seed=23)


def check(r, ref, p, max_tokens, sampling, stop=EOS):
    want = ref.generate(p, SamplingParams(**sampling), max_tokens, stop)
    assert r.token_ids == want.token_ids
    assert len(r.logprobs) == len(r.token_ids) == len(want.logprobs)
    for pos, ((lp, top), w) in enumerate(zip(r.logprobs, want.logprobs)):
        assert abs(lp - w.logprob) < 1e-5, (pos, lp, w.logprob)
        assert [t for t, _ in top] == [t for t, _ in w.top], pos
        assert max(abs(a - b) for (_, a), (_, b) in zip(top, w.top)) < 1e-5, pos
    assert 17 not in r.token_ids  # a bias of -100 keeps a token out


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("pipeline,handoff", [("pdd", "one-shot"), ("pdd", "chunked"), ("pd-cross", None),
                                              ("pd-local", None)])
def test_penalties_bias_and_logprobs_match_the_reference(client, ref, pipeline, handoff, sampling):
    seed = 1000 + zlib.crc32(f"{pipeline}{handoff}{bool(sampling)}".encode()) % 1000  # test_pipelines draws < 1000
    p = prompt(30 + seed % 40, seed)
    params = {**FEATURES, **sampling}
    r = client.generate(make_request(p, max_tokens=20, pipeline=pipeline, handoff=handoff, **params), timeout=240)
    check(r, ref, p, 20, params)
    assert r.pipeline == pipeline


@pytest.mark.parametrize("handoff", ["one-shot", "chunked"])
def test_the_switch_to_md_keeps_penalties_and_logprobs_exact(client, ref, stack, handoff):
    """A slowed A -> B link: RLD streams first, MD takes over from RLD's token ids alone and
    must count the same penalties; the router joins RLD's and MD's logprobs in order."""
    stack.link.set(mbps=2.0)
    params = {**FEATURES, **SEEDED}
    try:
        for attempt in range(4):  # a cold MD compiling may let RLD finish alone: then a fresh prompt
            p = prompt(120, 170 + attempt + (10 if handoff == "chunked" else 0))
            r = client.generate(make_request(p, max_tokens=300, pipeline="pdd", handoff=handoff, ignore_eos=True,
                                             **params), timeout=240)
            check(r, ref, p, 300, params, stop=())
            if "main" in r.sources:
                break
    finally:
        stack.link.set()
    assert r.sources[0] == "relay" and r.sources[-1] == "main", (r.usage, r.timings)


@pytest.mark.parametrize("field,value,words", [
    ("presence_penalty", 2.5, "presence_penalty must be a number in [-2, 2]"),
    ("repetition_penalty", -1.0, "repetition_penalty must be a number in (0, 2]"),
    ("logit_bias", {600: 1.0}, "logit_bias token id 600 is not a token id in [0, 512)"),
    ("logit_bias", {3: 150.0}, "logit_bias of token 3 must be a number in [-100, 100]"),
    ("top_logprobs", 21, "top_logprobs must be an integer in [0, 20]"),
])
def test_out_of_range_values_are_refused_by_name(client, field, value, words):
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    with pytest.raises(RouterError) as e:
        client.generate(make_request(prompt(10, 1), max_tokens=4, pipeline="pdd", **{field: value, **extra}),
                        timeout=60)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in str(e.value), str(e.value)
