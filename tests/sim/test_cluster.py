"""Whole-cluster invariants, tail-chunk batching, and the drift feedback loop."""

import dataclasses

import pytest

import pddjax.sim.cluster as cluster_mod
from pddjax.sim.cluster import Cluster
from pddjax.sim.config import ClusterConfig, Pool, Sla
from pddjax.sim.events import EventLoop, SimError
from pddjax.sim.hardware import get_accelerator
from pddjax.sim.measured import MeasuredInstance
from pddjax.sim.model import get_model
from pddjax.sim.roofline import RooflineInstance
from pddjax.sim.runner import simulate_workload
from pddjax.workload import PRESETS, fixed_hit_mix, generate

MODEL = get_model("flagship-50k")
A = RooflineInstance.build(get_accelerator("gpu-a"), MODEL)
B = RooflineInstance.build(get_accelerator("gpu-b"), MODEL)
WL = dataclasses.replace(PRESETS["default"], duration_s=60.0, session_rate=0.5, warm_start_s=60.0)


class CheckedLoop(EventLoop):
    """Event loop that also checks each event runs at or after the previous one."""

    def run(self, until=float("inf"), max_events=10**7):
        last = -float("inf")
        while self._heap and self._heap[0][0] <= until:
            t, _, fn, args = self._heap[0]
            assert t >= last - 1e-9, "event ran before an earlier-scheduled one"
            last = t
            super().run(until=t, max_events=max_events)


def run(cfg, wl=WL, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setattr(cluster_mod, "EventLoop", CheckedLoop)
    cl = Cluster(cfg, generate(wl, until=wl.duration_s), wl.duration_s)
    return cl, cl.run()


CONFIGS = [
    ClusterConfig("pd-local", Pool(A, 2), Pool(A, 1)),
    ClusterConfig("pd-cross", Pool(A, 2), Pool(B, 1), wan_gbps=2.0),
    ClusterConfig("pdd", Pool(A, 2), Pool(B, 1), Pool(A, 1), wan_gbps=2.0),
    ClusterConfig("pdd", Pool(A, 2), Pool(B, 1), Pool(A, 1), wan_gbps=2.0, handoff="oneshot", batch_extend=False),
    ClusterConfig("pdd", Pool(A, 2), Pool(B, 1), Pool(A, 1), wan_gbps=1.0, wan_sharing="fifo",
                  rld_normal_path=True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.mode}-{c.handoff}-{c.wan_sharing}-{c.rld_normal_path}")
def test_conservation_causality_and_shares(cfg, monkeypatch):
    cl, done = run(cfg, monkeypatch=monkeypatch)
    assert len(done) == cl.n_sent > 50
    assert len({r.rid for r in done}) == len(done)  # each request finished exactly once
    for r in done:
        assert r.arrival <= r.prefill_start <= r.prefill_end <= r.first_token <= r.finish
        assert r.rld_tokens + r.md_tokens == r.output
        assert 0 <= r.rld_tokens <= r.output
    cl.check_integrity()
    if cfg.mode == "pdd":
        assert any(r.pipeline != "P-MD" for r in done)  # the slow line does route via RLD


def test_drc_capacity_never_exceeded_under_pressure():
    small = MeasuredInstance.from_json({"decode_ms": {"1": 5, "32": 8}, "extend_ms": {"1": 5, "64": 9},
                                        "prefill_tokens_per_s": 200_000, "kv_capacity_tokens": 60_000,
                                        "kv_bytes_per_token": 50_000})
    cfg = ClusterConfig("pdd", Pool(A, 2), Pool(small, 2), Pool(A, 1), wan_gbps=2.0)
    cl = Cluster(cfg, generate(WL, until=WL.duration_s), WL.duration_s)
    for t in range(0, 200, 2):  # audit the pools while the simulation runs
        cl.loop.at(float(t), cl.check_integrity)
    cl.run()
    assert sum(d.cache.evictions for d in cl.D) > 0
    assert all(d.cache.peak <= d.cache.capacity for d in cl.D)


def test_too_long_request_is_reported():
    tiny = MeasuredInstance.from_json({"decode_ms": {"1": 5}, "extend_ms": {"1": 5},
                                       "prefill_tokens_per_s": 1e5, "kv_capacity_tokens": 1000})
    with pytest.raises(SimError, match="KV tokens"):
        run(ClusterConfig("pd-local", Pool(tiny, 1), Pool(tiny, 1)))


def test_tail_chunk_batching_raises_throughput_in_the_valley():
    # Decode-bound MD whose forward pass costs mostly a weight read, every request relayed
    # through RLD at a 50% hit rate: each handoff chunk is either folded into a decode step or
    # costs MD a pass of its own.
    md = MeasuredInstance.from_json({"decode_ms": {"1": 20, "64": 24}, "extend_ms": {"1": 20, "64": 26},
                                     "prefill_tokens_per_s": 2e6, "kv_capacity_tokens": 10**7,
                                     "kv_bytes_per_token": 50_000})
    wl = dataclasses.replace(WL, hit_mix=fixed_hit_mix(0.5), output_fixed=200, session_rate=3.0)
    spans = {}
    for batched in (True, False):
        cfg = ClusterConfig("pdd", Pool(md, 4), Pool(md, 1), Pool(md, 4), wan_gbps=100.0, rld_threshold_s=0.0,
                            singular_filter=False, batch_extend=batched, tpot_target_s=10.0)
        cl, done = run(cfg, wl)
        assert sum(r.pipeline == "P-RLD-MD" for r in done) > 0.8 * len(done)
        tokens = sum(d.tokens_out for d in cl.D)
        spans[batched] = tokens / max(r.finish for r in done)
    assert spans[True] > 1.05 * spans[False]


def test_drift_lowers_md_hit_only_when_p_rld_is_a_normal_path():
    wl = dataclasses.replace(PRESETS["default"], duration_s=240.0, session_rate=0.15, turns_mean=12.0,
                             warm_start_s=240.0)
    base = ClusterConfig("pdd", Pool(A, 2), Pool(B, 1), Pool(A, 1), wan_gbps=2.0)
    out = {flag: simulate_workload(base.replace(rld_normal_path=flag), wl, Sla(), timeline_bins=6)
           for flag in (False, True)}
    normal, drift = out[False], out[True]
    # the normal path sends only singular turns P-RLD, and syncs their context to MD afterwards
    assert drift["pipelines"].get("P-RLD", 0) > 3 * normal["pipelines"].get("P-RLD", 0)
    assert drift["mean_md_hit"] < normal["mean_md_hit"] - 0.03
    assert drift["mean_md_hit"] < drift["mean_p_hit"] - 0.03  # MD fell below P
    assert normal["mean_md_hit"] > normal["mean_p_hit"] - 0.03  # MD keeps up with P
    first, last = drift["timeline"][0][1], drift["timeline"][-1][1]
    assert last < first - 0.03  # MD's hit rate keeps falling: the feedback loop
    n_first, n_last = normal["timeline"][0][1], normal["timeline"][-1][1]
    assert n_last > n_first - 0.03  # ... and does not without it
