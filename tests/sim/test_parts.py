"""Simulator building blocks: event loop, line, cache, lineage, timing profiles."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddjax.sim.cache import PrefixCache
from pddjax.sim.events import EventLoop, SimError
from pddjax.sim.hardware import get_accelerator
from pddjax.sim.lineage import Lineage
from pddjax.sim.measured import MeasuredInstance, interp
from pddjax.sim.model import get_model
from pddjax.sim.roofline import RooflineInstance, chips_for
from pddjax.sim.wan import Line

GB8 = 1e9 / 8  # bytes per second in one Gb/s


def test_event_loop_orders_and_refuses_the_past():
    loop, seen = EventLoop(), []
    loop.at(2.0, seen.append, "b")
    loop.at(1.0, seen.append, "a")
    loop.at(2.0, seen.append, "c")
    loop.run()
    assert seen == ["a", "b", "c"] and loop.now == 2.0
    with pytest.raises(SimError):
        loop.at(1.0, seen.append, "late")


@pytest.mark.parametrize("sharing, first, second", [("fair", 2.0, 2.0), ("fifo", 1.0, 2.0)])
def test_line_sharing(sharing, first, second):
    loop, done = EventLoop(), {}
    line = Line(loop, gbps=1.0, latency_s=0.01, sharing=sharing)
    line.send(GB8, lambda: done.setdefault("a", loop.now))
    line.send(GB8, lambda: done.setdefault("b", loop.now))
    loop.run()
    assert done["a"] == pytest.approx(first + 0.01) and done["b"] == pytest.approx(second + 0.01)
    assert line.bytes_sent == pytest.approx(2 * GB8)


def test_line_cancel_counts_partial_bytes_and_frees_bandwidth():
    loop, done = EventLoop(), {}
    line = Line(loop, gbps=1.0, latency_s=0.0)
    a = line.send(GB8, lambda: done.setdefault("a", loop.now))
    line.send(GB8, lambda: done.setdefault("b", loop.now))
    loop.at(1.0, line.cancel, a)  # each got 0.5 s worth so far
    loop.run()
    assert "a" not in done and a.sent == pytest.approx(GB8 / 2)
    assert done["b"] == pytest.approx(1.5)  # the rest at full rate
    assert line.predict_s(GB8) == pytest.approx(1.0)


def test_cache_lru_and_reservations():
    c = PrefixCache(100)
    assert c.insert("a", 40) and c.insert("b", 40)
    c.touch("a")
    assert c.reserve(50)  # evicts b (least recently used), keeps a
    assert c.get("b") is None and c.get("a") is not None
    assert not c.reserve(60)  # 50 reserved + 60 > 100 even with a evicted
    e = c.take("a")
    assert e.tokens == 40 and c.reserved == 90 and c.cached == 0
    c.release(90)
    c.check_integrity()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ins", "res", "rel", "take"]), st.integers(0, 5),
                          st.integers(1, 60)), max_size=60))
def test_cache_never_exceeds_capacity(ops):
    c, held = PrefixCache(100), []
    for op, key, n in ops:
        if op == "ins":
            c.insert(key, n)
        elif op == "res" and c.reserve(n):
            held.append(n)
        elif op == "rel" and held:
            c.release(held.pop())
        elif op == "take":
            e = c.take(key)
            if e:
                held.append(e.tokens)
        c.check_integrity()
        assert c.reserved + c.cached <= c.capacity


def test_lineage_composes_prefixes_by_minimum():
    lin = Lineage()
    for turn, prefix in enumerate([500, 900, 300, 950]):
        lin.add(7, turn, prefix)
    assert lin.shared_with_turn(7, 3, 2, 1000) == 950
    assert lin.shared_with_turn(7, 3, 1, 1000) == 300  # turn 2 kept only 300 tokens
    assert lin.shared_with_doc(7, 3, 800) == 300
    with pytest.raises(ValueError):
        lin.add(7, 9, 1)


def test_roofline_regimes():
    m = get_model("flagship-50k")
    a = RooflineInstance.build(get_accelerator("gpu-a"), m)
    assert a.chips == chips_for(m, get_accelerator("gpu-a")) == 8
    # decode is memory-bound: one more sequence costs far less than the weight read
    assert a.step_s(2, 2 * 1000) < 1.05 * a.step_s(1, 1000)
    # prefill is compute-bound and superlinear in length (attention)
    assert a.prefill_s(8192, 0) > 2 * a.prefill_s(4096, 0)
    assert a.kv_capacity_tokens > 0 and a.cost_per_hour == 8 * 2.0


def test_measured_profile_interpolates_and_rejects_bad_input():
    assert interp([(1, 1.0), (3, 3.0)], 2) == 2.0 and interp([(1, 1.0), (3, 3.0)], 5) == 5.0
    perf = MeasuredInstance.from_json({"decode_ms": {"1": 10, "32": 20}, "extend_ms": {"1": 10, "64": 30},
                                       "prefill_tokens_per_s": 1000})
    assert perf.step_s(1, 0) == pytest.approx(0.010)
    assert perf.step_s(32, 0, ext_tokens=64) == pytest.approx(0.020 + 0.020)
    assert perf.prefill_s(500, 0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        MeasuredInstance.from_json({"decode_ms": {"1": 1}, "extend_ms": {"1": 1}})
    with pytest.raises(ValueError, match="decode_ms"):
        MeasuredInstance.from_json({"extend_ms": {"1": 1}, "prefill_tokens_per_s": 5})
