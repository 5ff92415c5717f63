"""The router knows its link before the first request (issue 16): a fresh `pddjax up` behind a
slow emulated A -> B link (20 Mb/s, 20 ms one way), tiny model, and at once a cold long prompt
with pipeline `auto`.

The router probes MD's link at its start (over MD's WAN address, the path P's KV takes), so the
first request's estimate is the line's: 480 tokens of KV (246 KB, 512 B a token) take ~140 ms
(a 42 ms round trip + 98 ms), past the budget, so it goes pdd, with exactly the reference's
tokens, and its explanation names the probe. The request does not race the probe: one that
arrives while the first probe runs waits for it (here < 1 s; `wan_probe_wait_ms` at most).
The budget is scaled to the tiny model (50 ms: its KV is ~90x lighter than SmolLM2's, whose
600-token prompt at 100 Mb/s is the issue's case).
The control: the same stack with `wan_probe = false` decides from the 1,000 Mb/s prior (22 ms:
within the budget) and goes pd-cross, so this test fails without the probe."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from pddjax.model.sampling_params import SamplingParams
from serving.client import Client, make_request
from tests.support.serving_stack import launch_up
from tests.support.stack_checks import router_stats

pytestmark = pytest.mark.timeout(400)

MBPS, LATENCY_MS = 20, 20
STACK = {
    "model": "tiny", "platform": "cpu",
    "engine": {"dtype": "float32", "page_size": 16, "num_pages": 256, "max_step_tokens": 128, "max_rows": 8},
    "router": {"chunk_bytes": 16384, "ttft_budget_ms": 50},
}
PROMPT = np.random.default_rng(16).integers(3, 512, 480).tolist()
MAX_TOKENS = 16


def first_request(tmp_path, probe: bool):
    """A fresh `pddjax up` over the slow link; its first request, at once -> (result, Stats)."""
    up = launch_up(tmp_path, {**STACK, "router": {**STACK["router"], "wan_probe": probe}},
                   "--wan-mbps", str(MBPS), "--wan-latency-ms", str(LATENCY_MS))
    try:
        c = Client(up.state["router"])
        try:
            r = c.generate(make_request(PROMPT, max_tokens=MAX_TOKENS, pipeline="auto", ignore_eos=True), timeout=240)
        finally:
            c.close()
        return r, router_stats(up.state["router"])
    finally:
        up.close()


def test_cold_long_prompt_goes_pdd_at_its_first_request(tmp_path, ref):
    r, st = first_request(tmp_path, probe=True)
    print(r.pipeline, r.ttft_ms, r.explain, json.dumps(st["links"]), sep="\n")
    assert r.token_ids == ref.generate(PROMPT, SamplingParams(), MAX_TOKENS, ()).token_ids
    assert r.pipeline == "pdd", r.explain
    assert re.search(r"\(probe, \d+ s ago; ", r.explain), r.explain
    assert 0.6 * MBPS <= float(re.search(r"at ([\d.]+) Mb/s", r.explain).group(1)) <= 1.25 * MBPS, r.explain
    (link,) = st["links"].values()
    (main,) = [i["address"] for i in st["instances"] if i["role"] == "main"]
    assert link["probe"]["via"] != main and not link["probe"]["error"], link  # over the link, as P's KV goes
    assert 0.6 * MBPS <= link["probe"]["mbps"] <= 1.25 * MBPS, link  # the probe measured the line
    assert 2 * LATENCY_MS <= link["probe"]["rtt_ms"] < 2 * LATENCY_MS + 40, link
    assert st["counters"]["link_probes"] == 1 and st["counters"]["decision.pdd.mask"] == 1


def test_without_the_probe_the_prior_sends_it_pd_cross(tmp_path, ref):
    r, st = first_request(tmp_path, probe=False)
    print(r.pipeline, r.ttft_ms, r.explain, sep="\n")
    assert r.token_ids == ref.generate(PROMPT, SamplingParams(), MAX_TOKENS, ()).token_ids
    assert r.pipeline == "pd-cross" and "at 1000.0 Mb/s + 20 ms (prior; " in r.explain, r.explain
    assert "link_probes" not in st["counters"]
