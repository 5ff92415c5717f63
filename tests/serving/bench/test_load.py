"""`pddjax bench serving` (serving/bench/load/command.py): the figures from hand-made streams and
router scrapes, and one small run end to end on the tiny model (configs/tiny.toml's engine shapes, so the
step executables come from the compile cache the other stack tests fill): 4 streams per pipeline
token-exact against the reference, every report field, and bursts of 16 streams of 224 prompt
+ 128 output tokens (22 pages each, reserved at admission: 11 fit) that the 255-page pools
cannot hold at once, pd-local (RLD queues) and pdd (MD queues), completed token-exact with no
refusal and page waits seen. (The pages come mostly from the prompt: the same queueing with
half of the decode steps and of the reference's tokens that 32 + 256 took. With 64 output
tokens, 14 fit, and the pd-local burst saw no wait in 4 runs of 4 once the engine's steps got
faster: two waits were too few a margin.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from serving.bench.load import command as sl
from serving.bench.load import figures as serving_figures
from serving.pb import common_pb2

pytestmark = pytest.mark.timeout(600)


def stream(t0, gaps, sizes, tokens, error=None):
    times, t = [], t0
    for g in gaps:
        t += g
        times.append(t)
    return sl.Stream(tokens=tokens, times=times, sizes=sizes, error=error)


def test_burst_figures_time_and_exactness():
    a = stream(10.0, [0.1, 0.02, 0.04], [1, 1, 2], [5, 6, 7, 8])  # TTFT 100 ms, gaps 20 and 40 (2 tokens)
    b = stream(10.0, [0.2, 0.01], [2, 1], [1, 2, 3])
    fig = sl.burst_figures(10.0, [a, b], [[5, 6, 7, 8], [1, 2, 3]])
    assert fig["exact"] and fig["completed"] == 2 and fig["output_tokens"] == 7
    assert fig["ttft_ms"]["p50"] == pytest.approx(150.0) and fig["ttft_ms"]["max"] == pytest.approx(200.0)
    assert fig["itl_ms"]["n"] == 4  # 20, 20, 20 (40 ms over 2 tokens) and 10
    assert fig["itl_ms"]["max"] == pytest.approx(20.0) and fig["max_gap_ms"]["max"] == pytest.approx(40.0)
    assert fig["e2e_ms"]["max"] == pytest.approx(210.0)
    assert fig["tokens_per_s"] == pytest.approx(7 / 0.21, abs=0.1)
    assert fig["tokens_per_message"] == pytest.approx(7 / 5)
    assert fig["message_itl_ms"]["n"] == 3 and fig["message_itl_ms"]["max"] == pytest.approx(40.0)  # one per message
    assert fig["tpot_ms"]["n"] == 2 and fig["tpot_ms"]["max"] == pytest.approx(20.0)  # (e2e - TTFT) / (n - 1): 60/3
    assert fig["tpot_ms"]["mean"] == pytest.approx(12.5)  # and 10/2
    wrong = sl.burst_figures(10.0, [a, b], [[5, 6, 7, 8], [1, 2, 4]])
    assert not wrong["exact"] and wrong["mismatched"] == [1]
    failed = sl.burst_figures(10.0, [a, sl.Stream(error="RESOURCE_EXHAUSTED: full")], [[5, 6, 7, 8], [1]])
    assert not failed["exact"] and failed["errors"] == {"RESOURCE_EXHAUSTED": 1} and failed["completed"] == 1


def test_a_mismatch_at_a_float_tie_is_told_apart_from_a_wrong_token(tiny):
    """The pdd 64-burst's prompt 30 (seed tag 1010) has a 1.2e-6 logit gap between its top two
    tokens at output position 15 (session 8: one batched run took the other one). A stream that
    took the runner-up there is a near-tie; one wrong where the gap is wide is not."""
    import numpy as np

    from pddjax.engines.reference import ReferenceEngine
    from pddjax.model.sampling_params import GREEDY

    prompt = sl.make_prompts(1010, 64, 32, tiny.config.vocab_size)[30]
    steps = list(ReferenceEngine(tiny.config, tiny.weights).stream(prompt, GREEDY, 17, stop_ids=(), return_logits=True))
    ref = [t for t, _ in steps]
    runner_up = int(np.argsort(steps[15][1])[-2])
    tie = ref[:15] + [runner_up, 1]  # took the other side of the tie, then went its own way
    wrong = ref[:16] + [(ref[16] + 1) % tiny.config.vocab_size]  # position 16: a wide gap
    gaps = [0.01] * 17
    fig = sl.burst_figures(0.0, [stream(0.0, gaps, [1] * 17, t) for t in (ref, tie, wrong)], [ref] * 3)
    assert fig["diverged_at"] == [[1, 15], [2, 16]]
    sl.explain_mismatches(fig, tiny, [prompt] * 3)
    (_, _, tie_gap), (_, _, wide_gap) = fig["mismatch_margins"]
    assert tie_gap < serving_figures.TIE_MARGIN < wide_gap and fig["near_ties"] == 1 and not fig["exact"]


def test_page_wait_delta_counts_only_the_burst():
    def scrape(count, total, buckets, failures):
        return {"page_wait": {"relay": {"count": count, "sum": total, "buckets": buckets}}, "failures": failures}

    before = scrape(4, 0.0, {"0.001": 4, "0.5": 4, "+Inf": 4}, {"CANCELLED": 1})
    after = scrape(10, 1.2, {"0.001": 6, "0.5": 9, "+Inf": 10}, {"CANCELLED": 1, "RESOURCE_EXHAUSTED": 2})
    d = sl.page_wait_delta(before, after)["relay"]
    assert d["count"] == 6 and d["waited"] == 4 and d["mean_s"] == pytest.approx(0.2)
    assert d["p50_le_s"] == 0.5 and d["p99_le_s"] == float("inf")
    assert sl.failures_delta(before, after) == {"RESOURCE_EXHAUSTED": 2}
    assert sl.per_token({"router": 0.5, "relay": 0.25}, 1000) == {"router": 500.0, "relay": 250.0}
    assert sl.per_token({"router": 0.5}, 0) == {}


def test_bench_serving_small_run(tmp_path):
    out = tmp_path / "serving.json"
    p = subprocess.run([sys.executable, "-m", "serving", "bench", "serving", "--streams", "4", "--max-tokens", "16",
                        "--burst", "16", "--burst-tokens", "128", "--prompt-tokens", "224", "--num-pages", "256",
                        "--max-rows", "8", "--max-step-tokens", "128", "--stream-interval", "1,4", "--json", str(out)],
                       capture_output=True, text=True, timeout=580)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["stack"]["engine"]["max_rows"] == 8 and res["stack"]["wan"]["mbps"] == 1000.0
    eng = res["engine"]["4"]
    assert eng["decode_tokens_per_s"] > 0 and eng["burst_tokens_per_s"] > 0 and eng["decode_step_ms"] > 0
    assert eng["first_tokens_s"] > 0 and eng["load_1m"] >= 0
    assert set(res["serving"]) == set(sl.PIPELINES)
    for name, per in res["serving"].items():
        f = per["4"]
        assert f["exact"] and f["completed"] == 4 and f["output_tokens"] == 64 and not f["errors"], (name, f)
        for k in ("ttft_ms", "itl_ms", "max_gap_ms", "e2e_ms"):
            assert f[k]["p50"] is not None and f[k]["p99"] >= f[k]["p50"], (name, k, f[k])
        assert f["e2e_ms"]["p50"] >= f["ttft_ms"]["p50"] and f["tokens_per_s"] > 0 and f["load_1m"] >= 0
        assert f["compiles"] == {"prefill": 0, "relay": 0, "main": 0}, (name, f["compiles"])
        assert f["cpu_us_per_token"]["router"] == pytest.approx(1e6 * f["cpu_s"]["router"] / 64, abs=0.1)
        assert res["ratios"][name]["4"] == pytest.approx(f["tokens_per_s"] / eng["decode_tokens_per_s"], rel=1e-2)
    for name, per in res["serving"].items():  # 4 tokens a message: 1, 4, 4, 4, 3; the same tokens, exact
        one, four = per["4"], per["4@4"]
        assert four["exact"] and four["stream_interval"] == 4 and one["stream_interval"] == 1, (name, four)
        assert four["tokens_per_message"] >= 16 / 5 - 1e-6 and one["tokens_per_message"] < 2, name
        assert four["message_itl_ms"]["n"] <= 4 * 4 < one["message_itl_ms"]["n"] and four["tpot_ms"]["n"] == 4
        assert set(four["cpu_us_per_token"]) == set(one["cpu_us_per_token"])
    assert "| pdd | 4@4 |" in p.stdout
    assert res["serving"]["pd-local"]["4"]["main_token_share"] == 0.0
    assert res["serving"]["pd-cross"]["4"]["main_token_share"] == 1.0
    # pdd's handoffs done and MD given up, read off the router's metrics per cell: none outside pdd
    assert res["stack"]["router"]["give_up_main"] is True
    assert res["serving"]["pd-local"]["4"]["handoffs"] == {} == res["serving"]["pd-cross"]["4"]["handoffs"]
    pdd_handoffs = res["serving"]["pdd"]["4"]["handoffs"]
    assert set(pdd_handoffs) <= {"chunked", "one-shot", "given up, skipped", "given up, stopped"}, pdd_handoffs
    assert sum(pdd_handoffs.values()) <= 4 and "MD's token share" in p.stdout
    assert res["ratios"]["pdd_over_pd_local"]["4"] > 0
    for name, queued_on in (("pd-local", "relay"), ("pdd", "main")):  # pdd reserves MD before RLD
        b = res["burst"][name]["16"]  # 16 x 22 pages against 255, held to the end: 5 wait if all reserve at once
        assert b["completed"] == 16 and b["exact"] and b["refused"] == 0 and not b["errors"], (name, b)
        assert not b["router_failures"], (name, b["router_failures"])
        assert b["page_wait"][queued_on]["waited"] >= 2 and b["page_wait"][queued_on]["count"] == 16, b["page_wait"]
        assert b["ttft_ms"]["p99"] > b["ttft_ms"]["p50"] > 0
    assert len(res["load_avg"]["before"]) == 3 and len(res["load_avg"]["after"]) == 3
    assert "| pdd | 4 |" in p.stdout and "| 16 | pdd |" in p.stdout and "| 16 | pd-local |" in p.stdout


@pytest.mark.parametrize("handoff,mode", [(None, common_pb2.HANDOFF_MODE_UNSPECIFIED),
                                          ("one-shot", common_pb2.HANDOFF_MODE_ONE_SHOT),
                                          ("chunked", common_pb2.HANDOFF_MODE_CHUNKED)])
def test_a_burst_asks_for_the_chosen_handoff_mode(handoff, mode):
    """`--handoff` reaches every request of a burst (None: the router's own setting), beside the
    stream interval and the request ids the exactness check reads."""
    reqs = sl.burst_requests([[5, 6, 7], [8, 9]], 16, "pdd", "t", interval=4, handoff=handoff)
    assert [r.handoff for r in reqs] == [mode, mode]
    assert [r.request_id for r in reqs] == ["t-0", "t-1"] and {r.stream_interval for r in reqs} == {4}
    assert {r.pipeline for r in reqs} == {common_pb2.PIPELINE_PDD} and all(r.ignore_eos for r in reqs)
