"""A Decode service's Slot lifecycle (serving/engine/slot.py): the SlotState moves that
LEGAL_TRANSITIONS lists and no other, `check_integrity` catching a state that disagrees with the
slot's data or the engine's sequences, and the states a request passes through on a real MD
(pdd: reserved, held, decoding, closed) and RLD (decoding, handing off, decoding again), the
slot table's integrity reported by Info. A slot still waiting for its KV is dropped after
PDDJAX_KV_WAIT_SECONDS with its stream open; one past MD's final handoff is not.
"""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from pddjax.model.sampling_params import SamplingParams
from serving import rpc
from serving.engine import handoff
from serving.engine.decode import DecodeService
from serving.engine.slot import LEGAL_TRANSITIONS, WAITING, IllegalTransition, RpcFailure, Slot, SlotState, SlotTable
from serving.kvwire import chunks
from serving.pb import cluster_pb2
from tests.support.inprocess import Ctx, engine, prefill_runs
from tests.support.inprocess import aiter as _aiter

pytestmark = pytest.mark.timeout(120)
S = SlotState


def slot(state: SlotState = S.RESERVED, **kw) -> Slot:
    s = Slot("r", asyncio.Queue())
    s.state = state
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def seq(paused: bool = True):
    return SimpleNamespace(paused=paused)


# ---- the transition table -------------------------------------------------------------------
def test_every_state_has_a_row_and_closed_is_the_end():
    assert set(LEGAL_TRANSITIONS) == set(SlotState)
    assert LEGAL_TRANSITIONS[S.CLOSED] == set()
    assert all(S.CLOSED in nxt for st, nxt in LEGAL_TRANSITIONS.items() if st is not S.CLOSED)  # any may close
    assert WAITING == {S.RESERVED, S.HELD}


def test_the_lifecycles_a_request_lives_are_legal():
    paths = [
        [S.DECODING, S.CLOSED],  # RLD (MD in pd-cross): KV with P's token, then a finish
        [S.HELD, S.DECODING, S.CLOSED],  # MD in pdd: catch-up chunks, the final, a finish
        [S.DECODING, S.CLOSED],  # MD in pdd, a one-shot handoff (no catch-up chunk)
        [S.DECODING, S.HANDING_OFF, S.DECODING, S.HANDING_OFF, S.CLOSED],  # RLD: a failed final, then one taken
        [S.CLOSED],  # released (or expired) before its KV came
    ]
    for path in paths:
        s = slot()
        for st in path:
            s.move(st)
        assert s.state is path[-1] and s.closed


@pytest.mark.parametrize("src,dst", [(a, b) for a, b in itertools.product(SlotState, SlotState)
                                     if b not in LEGAL_TRANSITIONS[a]])
def test_a_move_the_table_does_not_list_is_refused(src, dst):
    s = slot(src)
    with pytest.raises(IllegalTransition) as e:
        s.move(dst)
    assert s.state is src  # unchanged
    assert f"from {src.name} to {dst.name}" in str(e.value) and "slot r" in str(e.value)


def test_the_refusal_names_the_legal_moves():
    with pytest.raises(IllegalTransition, match=r"HELD to HANDING_OFF \(legal: CLOSED, DECODING\)"):
        slot(S.HELD).move(S.HANDING_OFF)
    with pytest.raises(IllegalTransition, match=r"\(legal: none\)"):
        slot(S.CLOSED).move(S.RESERVED)


# ---- check_integrity: the state against the data --------------------------------------------
def test_consistent_slots_pass():
    slot(S.RESERVED).check_integrity(seq(paused=True))
    slot(S.HELD, waiters=[(30, None)]).check_integrity(seq(paused=False))
    slot(S.DECODING, emit_from=0).check_integrity(seq(paused=False))
    slot(S.DECODING, emit_from=7).check_integrity(seq(paused=True))  # MD paused by nobody: allowed
    slot(S.HANDING_OFF, emit_from=0).check_integrity(seq(paused=True))
    slot(S.CLOSED, emit_from=3).check_integrity(None)


@pytest.mark.parametrize("s,sq,words", [
    (slot(S.DECODING, emit_from=0), None, "DECODING but the engine holds no sequence"),
    (slot(S.RESERVED), None, "RESERVED but the engine holds no sequence"),
    (slot(S.CLOSED), seq(), "CLOSED but the engine still holds its sequence"),
    (slot(S.CLOSED, waiters=[(1, None)]), None, "CLOSED with 1 HandoffTokens still waiting"),
    (slot(S.DECODING), seq(False), "DECODING but has no emit_from"),
    (slot(S.HANDING_OFF), seq(True), "HANDING_OFF but has no emit_from"),
    (slot(S.RESERVED, emit_from=0), seq(True), "RESERVED but emits from 0"),
    (slot(S.HELD, emit_from=4), seq(False), "HELD but emits from 4"),
    (slot(S.RESERVED), seq(paused=False), "RESERVED but its sequence is not paused"),
    (slot(S.HANDING_OFF, emit_from=0), seq(paused=False), "HANDING_OFF but its sequence is not paused"),
    (slot(S.RESERVED, waiters=[(1, None)]), seq(True), "RESERVED with HandoffTokens waiting"),
])
def test_a_state_that_disagrees_with_the_data_is_caught(s, sq, words):
    with pytest.raises(AssertionError, match=words):
        s.check_integrity(sq)


class FakeEngine:
    def __init__(self, *rids):
        self.seqs = {rid: seq() for rid in rids}
        self.released = []

    def release(self, rid, cache=True):
        del self.seqs[rid]
        self.released.append((rid, cache))


class FakeWorker:
    def __init__(self):
        self.posted = []

    def post(self, fn, *args):
        self.posted.append((fn, args))

    def run_posted(self):
        posted, self.posted = self.posted, []
        for fn, args in posted:
            fn(*args)


def test_the_table_checks_its_slots_and_the_engines_sequences():
    eng, worker = FakeEngine("a", "b"), FakeWorker()
    table = SlotTable(eng, worker)
    a, b = Slot("a", asyncio.Queue()), Slot("b", asyncio.Queue())
    table.add(a)
    with pytest.raises(AssertionError, match=r"sequences with no slot: \['b'\]"):
        table.check_integrity()
    table.add(b)
    table.check_integrity()
    b.state = S.DECODING  # set behind move's back, with no emit_from
    with pytest.raises(AssertionError, match="slot b is DECODING but has no emit_from"):
        table.check_integrity()
    b.state = S.RESERVED
    table._slots["c"] = table._slots.pop("b")
    with pytest.raises(AssertionError, match="slot b is filed under c"):
        table.check_integrity()
    table._slots["b"] = table._slots.pop("c")

    table.close(a, RpcFailure(grpc.StatusCode.INTERNAL, "x"), cache=False)  # CLOSED, sequence released
    assert a.state is S.CLOSED and eng.released == [("a", False)] and "a" in table
    table.check_integrity()  # closed, still in the table until the event loop runs the posts
    table.close(a, RpcFailure(grpc.StatusCode.INTERNAL, "again"))  # a second close is a no-op
    assert eng.released == [("a", False)]
    worker.run_posted()
    assert "a" not in table and a.started.is_set() and a.out.qsize() == 1
    table.check_integrity()


def test_a_closed_slot_leaving_never_takes_a_newer_slot_with_its_id():
    eng, worker = FakeEngine("a"), FakeWorker()
    table = SlotTable(eng, worker)
    old = Slot("a", asyncio.Queue())
    table.add(old)
    table.close(old, RpcFailure(grpc.StatusCode.INTERNAL, "x"))
    new = Slot("a", asyncio.Queue())
    table.add(new)  # (the service refuses this while the old one is in the table; the table stays safe)
    worker.run_posted()
    assert table.get("a") is new


# ---- a real Decode service (tiny model) ----------------------------------------------------------
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=5)


def spec(rid, prompt, max_tokens=24):
    return cluster_pb2.SequenceSpec(request_id=rid, prompt=prompt, sampling=rpc.sampling_to_pb(SEEDED),
                                    max_tokens=max_tokens)


async def integrity(svc) -> str:
    return (await svc.Info(cluster_pb2.InfoRequest(), Ctx())).integrity_error


async def until(pred, timeout=30.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.01)


def test_mains_pdd_lifecycle_and_relays_handoff_pause(tiny):
    prompt = np.random.default_rng(3).integers(3, 512, 25).tolist()
    run = prefill_runs(tiny, {"m": prompt, "r": prompt}, SEEDED)

    async def main():
        svc = DecodeService("main", engine(tiny), tiny.config, {})
        svc.start(asyncio.get_running_loop())
        try:
            await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec("m", prompt), use_cache=False), Ctx())
            m = svc.slots.get("m")
            assert m.state is S.RESERVED and await integrity(svc) == ""
            await svc.PushKV(_aiter(chunks("m", run["m"], 0, [], 4096)), Ctx())  # pdd: no known token
            assert m.state is S.RESERVED and not m.started.is_set() and await integrity(svc) == ""
            await svc.HandoffTokens(cluster_pb2.HandoffTokensRequest(
                request_id="m", start_position=0, token_ids=[5, 6, 7], final=False, chunk_seq=0), Ctx())
            assert m.state is S.HELD and m.emit_from is None and await integrity(svc) == ""
            await svc.HandoffTokens(cluster_pb2.HandoffTokensRequest(
                request_id="m", start_position=0, token_ids=[5, 6, 7, 8], final=True, chunk_seq=1), Ctx())
            assert m.state in (S.DECODING, S.CLOSED) and m.emit_from == 4
            await until(lambda: "m" not in svc.slots)  # generated to max_tokens: closed, left the table
            assert m.state is S.CLOSED and m.started.is_set() and await integrity(svc) == ""

            await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec("r", prompt, 480), use_cache=False), Ctx())
            r = svc.slots.get("r")
            r.state = S.DECODING  # a state its data disagrees with: Info says so
            assert "slot r is DECODING but has no emit_from" in await integrity(svc)
            r.state = S.RESERVED
            await svc.PushKV(_aiter(chunks("r", run["r"], 0, [9], 4096)), Ctx())  # RLD: P's first token
            assert r.state is S.DECODING and r.emit_from == 0 and await integrity(svc) == ""
            await until(r.started.is_set)
            assert await svc.worker.call(handoff._pause, "r", svc.slots, urgent=True) is not None
            assert r.state is S.HANDING_OFF and await integrity(svc) == ""
            await svc.worker.call(handoff._resume, "r", svc.slots, urgent=True)  # the final failed: RLD decodes on
            assert r.state is S.DECODING and await integrity(svc) == ""
            await svc.Release(cluster_pb2.ReleaseRequest(request_id="r", cancel=True), Ctx())
            await until(lambda: "r" not in svc.slots)
            assert r.state is S.CLOSED and await integrity(svc) == ""
        finally:
            svc.worker.stop()

    asyncio.run(main())


def test_only_a_slot_still_waiting_for_its_kv_is_dropped_with_its_stream_open(tiny, monkeypatch):
    monkeypatch.setenv("PDDJAX_KV_WAIT_SECONDS", "0.3")
    prompt = np.random.default_rng(4).integers(3, 512, 20).tolist()
    run = prefill_runs(tiny, {"flowing": prompt}, SEEDED)

    async def main():
        svc = DecodeService("main", engine(tiny), tiny.config, {})
        svc.start(asyncio.get_running_loop())
        try:
            for rid in ("waiting", "flowing"):
                await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec(rid, prompt, 300), use_cache=False), Ctx())
                svc.slots.get(rid).streams = 1  # a Decode stream open on each
            waiting, flowing = svc.slots.get("waiting"), svc.slots.get("flowing")
            await svc.PushKV(_aiter(chunks("flowing", run["flowing"], 0, [], 4096)), Ctx())
            await svc.HandoffTokens(cluster_pb2.HandoffTokensRequest(
                request_id="flowing", start_position=0, token_ids=[5], final=True), Ctx())

            def hold(e):  # a long generation: no token now, no RPC about it either
                e.seqs["flowing"].paused = True
            await svc.worker.call(hold, urgent=True)
            assert flowing.state is S.DECODING
            await until(lambda: "waiting" not in svc.slots, timeout=10)
            failure = [waiting.out.get_nowait() for _ in range(waiting.out.qsize())][-1]
            assert failure.code == grpc.StatusCode.DEADLINE_EXCEEDED and "no KV for waiting" in failure.message
            await asyncio.sleep(0.6)  # twice the KV wait: past the final handoff, no KV is awaited
            assert flowing.state is S.DECODING and "flowing" in svc.slots and await integrity(svc) == ""
        finally:
            svc.worker.stop()

    asyncio.run(main())


def test_a_second_decode_stream_on_a_slot_is_refused_and_the_first_still_ends(tiny):
    """One reader per slot: a second Decode call while the first is open is ALREADY_EXISTS (it
    would wait forever for the items the first takes); the first ends on the Release."""
    from tests.support.inprocess import Refused

    async def main():
        svc = DecodeService("relay", engine(tiny), tiny.config, {})
        svc.start(asyncio.get_running_loop())
        try:
            spec = cluster_pb2.SequenceSpec(request_id="r", prompt=list(range(3, 23)), max_tokens=4,
                                            sampling=rpc.sampling_to_pb(SamplingParams()))
            await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=False), Ctx())
            first = svc.Decode(cluster_pb2.DecodeRequest(request_id="r"), Ctx())
            reading = asyncio.ensure_future(first.__anext__())
            await asyncio.sleep(0.05)
            with pytest.raises(Refused) as second:
                await asyncio.wait_for(svc.Decode(cluster_pb2.DecodeRequest(request_id="r"), Ctx()).__anext__(), 5)
            await svc.Release(cluster_pb2.ReleaseRequest(request_id="r", cancel=True), Ctx())
            return second.value, await asyncio.wait_for(reading, 5)
        finally:
            svc.worker.stop()

    second, ended = asyncio.run(main())
    assert second.code == grpc.StatusCode.ALREADY_EXISTS and "already has an open Decode stream" in second.message
    assert ended.finish_reason == rpc.FINISH["cancelled"]
