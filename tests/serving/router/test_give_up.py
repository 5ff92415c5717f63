"""Giving MD up (serving/router/give_up.py): a pdd request predicted to end on RLD before its
stream could move to MD gets no handoff, or its chunked handoff is stopped, and MD is released
keeping the prompt (cache=True). The clock's learning and rule; the stream staying on RLD once
MD is given up, even when MD would catch up later; the router's transfers with stand-in
stubs; and a real stack whose router assumes a long switch: the pdd request finishes on RLD
with the reference's tokens, MD released and idle, the skip counted."""

from __future__ import annotations

import asyncio
import collections

import pytest

from pddjax.engines.reference import ReferenceEngine
from pddjax.model.sampling_params import SamplingParams
from serving.config import RouterSettings
from serving.pb import cluster_pb2, common_pb2
from serving.router import give_up
from serving.router.estimates import Estimates
from serving.router.give_up import SwitchClock
from serving.router.metrics import RouterMetrics
from serving.router.pools import Instance
from serving.router.request import Request
from serving.router.request_state import State
from serving.router.transfer import Transfers
from tests.support.router_requests import batch, fed
from tests.support.router_requests import streaming_request as shared_streaming_request
from tests.support.samples import prompt

pytestmark = pytest.mark.timeout(300)


# ---- the clock ----------------------------------------------------------------------------------
def test_no_estimate_gives_nothing_up_and_a_prior_stands_in_for_one():
    clock = SwitchClock()
    assert not clock.due(0.0, 0.0) and clock.expected is None
    clock.check_integrity()
    assert SwitchClock(prior_s=2.0).due(1.9, 0.0) and not SwitchClock(prior_s=2.0).due(2.1, 0.0)


def test_switches_average_and_an_unswitched_handoff_only_raises_the_estimate():
    clock = SwitchClock()
    clock.switched(1.0)
    assert clock.expected == 1.0
    clock.switched(2.0)
    assert clock.expected == pytest.approx(1.0 + give_up.ALPHA * 1.0)
    clock.unswitched(0.5)  # ended unswitched after 0.5 s: says nothing the estimate does not
    assert clock.expected == pytest.approx(1.25)
    clock.unswitched(3.0)  # the switch takes longer than 3 s
    assert clock.expected == 3.0
    clock.gave_up()
    assert clock.expected == pytest.approx(3.0 * give_up.GIVE_UP_DECAY)
    assert clock.stats() == {"expected_s": clock.expected, "switches": 2, "unswitched": 2, "given_up": 1}
    clock.check_integrity()


def test_due_when_the_request_ends_before_the_switch_expected_after_the_time_run():
    clock = SwitchClock()
    clock.switched(1.0)
    assert clock.due(0.9, 0.0) and not clock.due(1.1, 0.0)
    assert clock.due(0.4, 0.5) and not clock.due(0.6, 0.5)
    assert not clock.due(0.0, 1.5)  # later than expected: no prediction left to act on


def test_pace_is_the_requests_own_after_a_few_tokens_and_remaining_is_bounded_by_max_tokens():
    assert give_up.relay_pace(2, 1.0, 1.1, 50.0) == pytest.approx(0.02)  # too few: the RLD's speed
    assert give_up.relay_pace(10, 1.0, 1.1, 50.0) == pytest.approx(0.01)
    assert give_up.remaining_seconds(100, 40, 0.01) == pytest.approx(0.6)
    assert give_up.remaining_seconds(100, 120, 0.01) == 0


@pytest.mark.parametrize("corrupt", [
    lambda c: setattr(c, "expected", -1.0),
    lambda c: setattr(c, "expected", None) or setattr(c, "switches", 1),
    lambda c: setattr(c, "expected", 1.0),  # an estimate from nothing
])
def test_check_integrity_catches_a_corrupt_clock(corrupt):
    clock = SwitchClock()
    corrupt(clock)
    with pytest.raises(AssertionError):
        clock.check_integrity()


# ---- the stream -----------------------------------------------------------------------------------
def streaming_request() -> Request:
    """The pdd request streaming from RLD, 8 tokens at most."""
    r = shared_streaming_request()
    r.max_tokens = 8
    return r


LENGTH = common_pb2.FINISH_REASON_LENGTH
WAVES = [[("relay", batch(0, [1, 2]))], [("relay", batch(2, [3]))],
         [("main", batch(2, [3, 4, 5]))],  # MD, emitting from its final, now holds the user's next token
         [("relay", batch(3, [4, 5, 6]))], [("main", batch(5, [6, 7, 8], finish_reason=LENGTH))],
         [("relay", batch(6, [7, 8], finish_reason=LENGTH))]]


@pytest.mark.parametrize("given_up", [False, True])
def test_a_stream_whose_md_was_given_up_stays_on_rld_even_when_md_catches_up(given_up):
    """The same batches: MD caught up and the stream switches, unless MD was given up at RLD's
    second batch (before MD emitted): then every token is RLD's and nothing switches."""
    asked, switched = [], []

    def give_up_fn():
        asked.append(len(r.tokens))
        return given_up and len(r.tokens) >= 2

    r = streaming_request()
    msgs = asyncio.run(fed(r, *WAVES, on_switch=lambda: switched.append(1), give_up=give_up_fn))
    assert r.tokens == [1, 2, 3, 4, 5, 6, 7, 8] and [t for m in msgs for t in m.token_ids] == r.tokens
    if given_up:
        assert set(r.sources) == {common_pb2.ROLE_RELAY} and r.handoff_at is None and not switched
        assert asked == [2]  # asked while MD had nothing to judge; never again once given up
    else:
        assert switched == [1] and r.handoff_at == 3 and common_pb2.ROLE_MAIN in r.sources
        assert asked == [2, 3]  # then MD's batch: the stream judged MD, not the clock


# ---- the router's transfers, with stand-in stubs ----------------------------------------------------
class Calls:
    """A stand-in Decode stub recording Release and Handoff calls."""

    def __init__(self, log: list, name: str, handoff_s: float = 5.0):
        self.log, self.name, self.handoff_s = log, name, handoff_s

    async def Release(self, req, timeout=None):
        self.log.append((self.name, "Release", req.cache, req.cancel))
        return cluster_pb2.ReleaseResponse()

    async def Handoff(self, req, timeout=None):
        self.log.append((self.name, "Handoff"))
        await asyncio.sleep(self.handoff_s)
        return cluster_pb2.HandoffResponse(handed_off=True, handed_off_at=3, chunks=2, tokens=3)


def transfers(**settings) -> tuple[Transfers, collections.Counter]:
    s = RouterSettings(**settings)
    counters = collections.Counter()
    return Transfers(s, None, Estimates(s), counters, RouterMetrics()), counters


def stubbed(r: Request, log: list) -> None:
    for inst in (r.relay, r.main):
        inst.channel = object()
        inst.stub = (inst.channel, Calls(log, inst.role))


def landing() -> cluster_pb2.TransferDone:
    return cluster_pb2.TransferDone(role=common_pb2.ROLE_MAIN, bytes=4096, ms=5.0)


@pytest.mark.parametrize(("prior_s", "enabled", "handed"), [(0.0, True, True), (60.0, True, False),
                                                             (60.0, False, True)])
def test_md_landing_starts_the_handoff_unless_the_request_ends_first(prior_s, enabled, handed):
    """MD's KV lands with 8 tokens left at 50 tokens/s (0.16 s): with no estimate, or the rule
    off, the handoff starts; with a 60 s switch assumed, MD is released keeping the prompt."""
    async def run():
        t, counters = transfers(handoff_switch_prior_s=prior_s, give_up_main=enabled)
        r, log = streaming_request(), []
        stubbed(r, log)
        t._transfer_done(r, landing())
        await asyncio.sleep(0.05)
        for task in r.tasks:
            task.cancel()
        return r, log, counters

    r, log, counters = asyncio.run(run())
    if handed:
        assert log == [("relay", "Handoff")] and r.handoff_t0 > 0 and not r.main_given_up
    else:
        assert log == [("main", "Release", True, True)] and r.main_given_up == "skipped"
        assert r.freed == [r.main] and counters == {"handoff.given_up.skipped": 1} and r.handoff_t0 == 0
    r.check_integrity()


def test_a_running_chunked_handoff_is_stopped_once_the_request_would_end_first():
    async def run():
        t, counters = transfers()
        r, log = streaming_request(), []
        stubbed(r, log)
        t._transfer_done(r, landing())  # no estimate yet: the handoff starts
        await asyncio.sleep(0.02)
        assert not t.stop_handoff(r)
        t.estimates.switch_clock(r.main).unswitched(30.0)  # another request's handoff: > 30 s
        assert t.stop_handoff(r) and t.stop_handoff(r)  # stopped once, then stays given up
        await asyncio.sleep(0.02)
        return r, log, counters, t

    r, log, counters, t = asyncio.run(run())
    assert r.handoff_task.cancelled() and r.main_given_up == "stopped"
    assert log == [("relay", "Handoff"), ("main", "Release", True, True)]
    assert counters == {"handoff.given_up.stopped": 1}
    clock = t.estimates.switch_clock(r.main)
    assert clock.given_up == 1
    t.learn_handoff(r, switched=False)  # a handoff given up teaches the clock nothing more
    assert clock.unswitched_count == 1
    r.check_integrity()


def test_a_switch_and_an_unswitched_end_teach_the_clock_of_that_md():
    t, _ = transfers()
    r = streaming_request()
    r.handoff_t0 = 1.0  # perf_counter long ago: the handoff ran for a while
    t.learn_handoff(r, switched=True)
    clock = t.estimates.switch_clock(r.main)
    assert clock.switches == 1 and clock.expected > 0
    other = Instance("main", "m:2")
    assert t.estimates.switch_clock(other).expected is None
    assert set(t.estimates.stats()["handoff_switch"]) == {"m:1", "m:2"}


def test_md_given_up_does_not_take_over_a_lost_rld():
    """MD was released: an RLD lost afterwards ends the request as in pd-local, never a take-over
    by an MD that holds nothing of it."""
    from serving.router import recovery

    r, counters = streaming_request(), collections.Counter()
    r.main_kv.set()
    r.main_kv_ok, r.first_token, r.main_given_up = True, 1, "skipped"
    why = asyncio.run(recovery.take_over(counters, r, [1, 2]))
    assert why.startswith("MD was released") and r.state is State.RELAY_STREAMING and not counters
    r.check_integrity()


# ---- a real stack ---------------------------------------------------------------------------------
ROUTER = {"router": {"chunk_bytes": 4096, "handoff_threshold": 48, "give_up_main": True,
                     "handoff_switch_prior_s": 600.0}}


def test_a_request_ending_before_the_expected_switch_finishes_on_rld_and_md_is_freed(tiny_stack, tiny):
    from serving.client import Client, make_request
    from tests.support.serving_stack import Router
    from tests.support.stack_checks import assert_idle, router_stats

    ref = ReferenceEngine(tiny.config, tiny.weights)
    stack = Router(tiny_stack, ROUTER)
    client = Client(stack.addr["router"])
    try:
        p = prompt(40, 9101)
        r = client.generate(make_request(p, max_tokens=24, pipeline="pdd", ignore_eos=True), timeout=240)
        assert r.token_ids == ref.generate(p, SamplingParams(), 24, ()).token_ids
        assert set(r.sources) == {"relay"} and r.usage["main_tokens"] == 0
        assert r.usage["kv_bytes_to_main"] > 0  # MD got the prompt's KV (its DRC keeps it)
        stats = router_stats(stack.addr["router"])
        assert stats["counters"].get("handoff.given_up.skipped") == 1, stats["counters"]
        assert "handoff.chunked" not in stats["counters"] and "handoff.one-shot" not in stats["counters"]
        assert_idle(stack, timeout=30)
        # the next turn of that context finds it in MD's DRC
        again = client.generate(make_request(p, max_tokens=4, pipeline="pd-cross", ignore_eos=True), timeout=240)
        assert again.usage["cached_on_main"] >= 32, again.usage
    finally:
        client.close()
        stack.close()
