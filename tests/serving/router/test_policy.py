"""The router's decision function on constructed inputs (every branch), its estimators, and a
trace test: under a trace where the singular filter fires, MD's hit rate does not drift below
P's (with the drift guard), while a naive filter (no background sync) drifts."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pddjax import policy
from pddjax.policy import PD_CROSS, PD_LOCAL, PDD, Inputs, LinkEstimator, PolicyConfig, decide

CFG = PolicyConfig(ttft_budget_s=0.5, filter_cap=0.05, drift_tolerance=0.2, handoff_threshold=64)
MB = 1e6 / 8  # bytes/s per Mb/s


def inputs(**kw) -> Inputs:
    base = dict(prompt_tokens=10_000, max_tokens=200, hit_prefill=9_000, hit_main=9_000, kv_bytes_per_token=50_000,
                wan_bytes_per_s=10_000 * MB, wan_latency_s=0.02, wan_queue_bytes=0, relay_tokens_per_s=50.0)
    return Inputs(**{**base, **kw})


def test_high_hit_goes_pd_cross():
    # 1,000 tokens x 50 KB = 50 MB over 10 Gb/s = 40 ms + 20 ms latency: within 500 ms
    d = decide(inputs(), CFG)
    assert (d.pipeline, d.reason) == (PD_CROSS, "fast-delta")
    assert d.delta_tokens == 1000 and d.delta_bytes == 50_000_000
    assert abs(d.transfer_s - (0.02 + 0.04)) < 1e-9


def test_full_hit_needs_no_transfer():
    d = decide(inputs(hit_main=10_000, wan_bytes_per_s=1.0), CFG)
    assert d.pipeline == PD_CROSS and d.transfer_s == 0.0 and d.delta_bytes == 0


def test_low_hit_goes_pdd_and_predicts_pending():
    # 9,000 tokens = 450 MB at 10 Gb/s = 360 ms + 20 ms: within; at 1 Gb/s: 3.62 s -> pdd
    assert decide(inputs(hit_main=1_000), CFG).pipeline == PD_CROSS
    d = decide(inputs(hit_main=1_000, wan_bytes_per_s=1000 * MB), CFG)
    assert (d.pipeline, d.reason) == (PDD, "mask")
    assert d.handoff_pending == int(d.transfer_s * 50) == 181 and d.handoff == "chunked"
    d = decide(inputs(hit_main=1_000, wan_bytes_per_s=4000 * MB), CFG)  # 0.92 s: 46 tokens pending
    assert (d.pipeline, d.handoff_pending, d.handoff) == (PDD, 46, "one-shot")
    assert policy.handoff_mode(64, 64) == "one-shot" and policy.handoff_mode(65, 64) == "chunked"


def test_measured_queue_pushes_a_request_off_pd_cross():
    assert decide(inputs(), CFG).pipeline == PD_CROSS
    d = decide(inputs(wan_queue_bytes=1_000_000_000), CFG)  # 1 GB ahead on the link
    assert d.pipeline == PDD and d.transfer_s > 0.8


def test_singular_traffic_is_filtered_and_synced_for_sessions():
    # low hit, slow link (3.62 s), 8 output tokens at 50 tok/s = 160 ms: RLD finishes first
    kw = dict(hit_main=1_000, hit_prefill=1_000, wan_bytes_per_s=1000 * MB, max_tokens=8)
    d = decide(inputs(**kw), CFG)
    assert (d.pipeline, d.reason, d.sync_main) == (PD_LOCAL, "singular", False)
    d = decide(inputs(session_id="s1", **kw), CFG)
    assert (d.pipeline, d.sync_main) == (PD_LOCAL, True)
    assert "cancelled" in d.explain(inputs(**kw)) and "background" in d.explain(inputs(**kw))


def test_session_prediction_decides_the_filter():
    kw = dict(hit_main=1_000, wan_bytes_per_s=1000 * MB, max_tokens=400)
    assert decide(inputs(**kw), CFG).pipeline == PDD  # 400 tokens = 8 s > 3.6 s
    d = decide(inputs(predicted_output=20, **kw), CFG)
    assert d.pipeline == PD_LOCAL and d.output_tokens == 20
    # a prediction never exceeds max_tokens
    assert decide(inputs(predicted_output=10_000, **{**kw, "max_tokens": 8}), CFG).output_tokens == 8


def test_cap_and_drift_guard_keep_singular_requests_on_md():
    kw = dict(hit_main=1_000, wan_bytes_per_s=1000 * MB, max_tokens=8)
    d = decide(inputs(filtered_share=0.05, **kw), CFG)
    assert (d.pipeline, d.reason) == (PDD, "cap")
    d = decide(inputs(session_id="s", session_drift=0.3, **kw), CFG)
    assert (d.pipeline, d.reason) == (PDD, "drift")
    assert decide(inputs(session_id="s", session_drift=0.1, **kw), CFG).pipeline == PD_LOCAL


def test_explain_names_every_input():
    i = inputs(hit_main=1_000, wan_bytes_per_s=1000 * MB)
    s = decide(i, CFG).explain(i)
    for part in ("pdd (mask)", "hit P 9000/10000", "MD 1000/10000", "delta 9000 tok = 450000000 B", "ms", "Mb/s",
                 "pending at handoff (chunked)"):
        assert part in s, (part, s)


def test_link_estimator_learns_throughput_latency_and_queue():
    est = policy.LinkEstimator(prior_mbps=1000, prior_latency_s=0.01)
    assert est.throughput.value == 1000 * MB
    est.done(0, 1000, 0.05)  # small: latency only
    assert est.latency.value == 0.05 and est.throughput.samples == 0
    est.start(10_000_000)
    assert est.queued == 10_000_000
    est.done(10_000_000, 10_000_000, 1.05)  # 10 MB in 1 s after latency: 80 Mb/s
    assert est.queued == 0 and abs(est.throughput.value - 10_000_000) < 1
    est.done(0, 10_000_000, 2.05)
    assert 5_000_000 < est.throughput.value < 10_000_000  # moving toward the new measurement
    est.done(0, 10_000_000, 0.0, ok=False)  # failed transfers teach nothing
    assert est.throughput.samples == 2


def test_session_tracker_and_filter_window():
    t = policy.SessionTracker(max_sessions=2)
    assert t.drift("a") == 0.0 and t.predicted_output("a") is None
    t.record_hits("a", 100, 90, 40)
    t.record_hits("a", 100, 90, 90)
    assert abs(t.drift("a") - 0.25) < 1e-9
    t.record_output("a", 7)
    t.record_output("a", 12)
    assert t.predicted_output("a") == 12
    t.record_output("b", 1)
    t.record_output("c", 1)  # evicts the least recently used
    assert "a" not in t.sessions and t.predicted_output("c") == 1
    w = policy.FilterWindow(4)
    for f in (True, False, False, False, False):
        w.add(f)
    assert w.share() == 0.0  # the True fell out of the window


# ---- the drift trace ----------------------------------------------------------------------

def run_trace(sync: bool, guard: bool, cap: float = 0.05, turns: int = 12, sessions: int = 40, seed: int = 0):
    """Sessions of growing context; some turns bring a big new attachment and a short answer
    (the singular shape). P and MD hold whatever reached them (P: every turn; MD: turns that
    ended on MD, and filtered turns only when synced). Returns (P hit rate, MD hit rate,
    filtered count) over all turns."""
    rng = random.Random(seed)
    cfg = dataclasses.replace(CFG, drift_tolerance=0.2 if guard else 2.0, filter_cap=cap)
    tracker, window = policy.SessionTracker(), policy.FilterWindow(cfg.filter_window)
    held_p, held_md = {}, {}
    hit_p = hit_md = total = filtered = 0
    for _ in range(turns):
        for s in range(sessions):
            sid = f"s{s}"
            ctx = held_p.get(sid, 0)
            new = rng.choice([200] * 3 + [6000])  # a large attachment now and then
            out = rng.choice([4, 8, 300])
            prompt = ctx + new
            hp, hm = held_p.get(sid, 0), held_md.get(sid, 0)
            i = Inputs(prompt_tokens=prompt, max_tokens=out, hit_prefill=hp, hit_main=hm, kv_bytes_per_token=50_000,
                       wan_bytes_per_s=1000 * MB, wan_latency_s=0.02, wan_queue_bytes=0, relay_tokens_per_s=50.0,
                       filtered_share=window.share(), session_id=sid, session_drift=tracker.drift(sid))
            d = decide(i, cfg)
            d = dataclasses.replace(d, sync_main=d.sync_main and sync)
            window.add(d.pipeline == PD_LOCAL)
            tracker.record_hits(sid, prompt, hp, hm)
            filtered += d.pipeline == PD_LOCAL
            held_p[sid] = prompt + out
            if d.pipeline != PD_LOCAL or d.sync_main:
                held_md[sid] = prompt + out
            hit_p, hit_md, total = hit_p + hp, hit_md + hm, total + prompt
    return hit_p / total, hit_md / total, filtered


def test_md_hit_rate_does_not_drift_when_the_filter_fires():
    p, md, filtered = run_trace(sync=True, guard=True)
    assert filtered >= 10  # the filter fired
    assert md >= p - 1e-9, (p, md)  # background sync: MD holds what P holds
    # a naive filter (no sync, no guard, no cap) feeds the loop: MD falls behind P
    p2, md2, filtered2 = run_trace(sync=False, guard=False, cap=1.0)
    assert filtered2 >= 10 and md2 < p2 - 0.05, (p2, md2)
    # the guard alone (no sync) bounds the drift: a lagging session is not filtered again
    p3, md3, _ = run_trace(sync=False, guard=True, cap=1.0)
    assert md2 < md3 and p3 - md3 < p2 - md2


def test_a_transfer_that_mostly_waited_on_prefill_does_not_over_read_the_link():
    """P's wire time excludes its waits on its own prefill, but bytes sent before a wait kept
    crossing the line during it: from a prefill-bound push only the lower bound counts."""
    link = LinkEstimator(prior_mbps=1000.0, prior_latency_s=0.02)
    link.seed(20e6 / 8, 0.02)  # the probe: 20 Mb/s
    mb = 1_000_000
    link.done(0, 10 * mb, seconds=1.0, total_seconds=5.0)  # wire time says 80 Mb/s: an over-read
    assert 8 * link.throughput.value / 1e6 == pytest.approx(20.0)
    link.done(0, 10 * mb, seconds=1.0, total_seconds=2.5)  # lower bound 10 MB / 2.48 s = 32 Mb/s: raises
    assert 8 * link.throughput.value / 1e6 == pytest.approx(8 * 10 * mb / 2.48 / 1e6)
    link.done(0, 10 * mb, seconds=4.0, total_seconds=4.5)  # link-bound: averaged in as before
    assert link.throughput.samples == 2 and link.source == "transfers"


def test_a_prefill_bound_transfer_lowers_an_estimate_above_its_wire_rate():
    """No probe landed (MD busy at the router's start): the estimate is the 1000 Mb/s prior. A
    prefill-bound push of 59 MB that spent 5 s on the wire (15 s in all) shows the line is no
    faster than ~95 Mb/s: the estimate comes down to that, not left at the prior for good."""
    link = LinkEstimator(prior_mbps=1000.0, prior_latency_s=0.02)
    link.done(0, 59_000_000, seconds=5.0, total_seconds=15.0)
    assert 8 * link.throughput.value / 1e6 == pytest.approx(8 * 59e6 / 4.98 / 1e6)
    assert link.source == "transfers"
    before = link.throughput.value
    link.done(0, 10_000_000, seconds=0.5, total_seconds=5.0)  # its over-read (160 Mb/s) is above: no change
    assert link.throughput.value == before
