"""The engine thread's order of work: urgent commands (a handoff's token append, RLD's pause)
before every queued ordinary one, and ordinary commands (KV imports of other requests) never
hold the next step back by more than their budget while sequences have work."""

from __future__ import annotations

import asyncio
import time

import pytest

from serving.engine import worker as worker_mod
from serving.engine.worker import EngineWorker

pytestmark = pytest.mark.timeout(60)


class Engine:
    """Records what ran on the engine thread, in order; `work` steps are pending."""

    def __init__(self, work: int = 0):
        self.log: list[str] = []
        self.work = work

    def has_work(self) -> bool:
        return self.work > 0

    def step(self) -> list:
        time.sleep(0.001)  # a step takes time: work lasts until the test ends it
        self.work -= 1
        self.log.append("step")
        return []


def count_wakeups(loop) -> list[int]:
    """[the loop's cross-thread wake-ups (call_soon_threadsafe) from now on], counted as they come."""
    wakeups, real = [0], loop.call_soon_threadsafe

    def counting(fn, *args):
        wakeups[0] += 1
        return real(fn, *args)

    loop.call_soon_threadsafe = counting
    return wakeups


def _slow(e: Engine, name: str, seconds: float) -> str:
    time.sleep(seconds)
    e.log.append(name)
    return name


async def _queue_then_release(w: EngineWorker, e: Engine, calls) -> list:
    """Holds the engine thread busy, queues `calls` meanwhile, then lets everything run."""
    blocker = w.call(_slow, "blocker", 0.3)
    await asyncio.sleep(0.05)  # the blocker is running: everything below queues behind it
    futs = [w.call(_slow, name, s, urgent=u) for name, s, u in calls]
    await asyncio.gather(blocker, *futs)
    return e.log


def test_urgent_commands_run_before_queued_ordinary_ones():
    async def main():
        e = Engine()
        w = EngineWorker(e, asyncio.get_running_loop())
        try:
            return await _queue_then_release(w, e, [("import1", 0, False), ("import2", 0, False),
                                                    ("handoff", 0, True), ("import3", 0, False)])
        finally:
            w.stop()

    log = asyncio.run(main())
    assert log == ["blocker", "handoff", "import1", "import2", "import3"]


def test_ordinary_commands_yield_to_the_step_after_their_budget():
    async def main():
        e = Engine(work=10**6)
        w = EngineWorker(e, asyncio.get_running_loop())
        try:
            # 5 imports of 2x the budget each: a step must run between any two of them
            slow = 2 * worker_mod.COMMAND_BUDGET_S
            return list(await _queue_then_release(w, e, [(f"import{i}", slow, False) for i in range(5)]))
        finally:
            e.work = 0
            w.stop()

    log = [x for x in asyncio.run(main()) if x != "blocker"]
    imports = [i for i, x in enumerate(log) if x.startswith("import")]
    assert len(imports) == 5
    assert all("step" in log[a:b] for a, b in zip(imports, imports[1:])), [x for x in log if x != "step"][:20]


def test_a_steps_posts_reach_the_loop_in_one_wake_up_in_order_before_the_caller_resumes():
    """Issue 18: the engine thread hands a step's per-stream posts (one per stream per token) to
    the event loop together, not one cross-thread wake-up each; what a command posted runs
    before the coroutine awaiting that command resumes."""
    got: list = []

    async def main():
        e = Engine(work=0)  # given its 3 steps once `w` is bound (the thread steps as soon as it starts)
        loop = asyncio.get_running_loop()
        wakeups = count_wakeups(loop)
        w = EngineWorker(e, loop, on_step=lambda events: [w.post(got.append, ("step", i)) for i in range(32)])
        e.work = 3
        try:
            await w.call(lambda eng: None)  # wakes the idle thread: it steps from here on
            while e.work:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            before, posted = wakeups[0], []
            await w.call(lambda eng: [w.post(posted.append, i) for i in range(5)])
            return before, list(posted)
        finally:
            w.stop()

    wakeups, posted = asyncio.run(main())
    assert got == [("step", i) for i in range(32)] * 3  # every post, in order
    assert wakeups <= 3 + 3, wakeups  # one hand-over per step (plus the wake-up's and the snapshot's), not 96
    assert posted == [0, 1, 2, 3, 4]  # ran before the awaiting coroutine resumed


def test_while_the_loop_is_busy_later_steps_posts_join_the_pending_hand_over():
    """The loop is woken once per hand-over it has not run yet: 10 steps while it is busy cost one
    wake-up, and their 40 posts still run in order."""
    got: list = []

    async def main():
        e = Engine(work=0)
        loop = asyncio.get_running_loop()
        wakeups = count_wakeups(loop)
        w = EngineWorker(e, loop, on_step=lambda events: [w.post(got.append, (e.work, i)) for i in range(4)])
        try:
            await w.call(lambda eng: None)
            before = wakeups[0]
            e.work = 10
            w.run_soon(lambda eng: None)  # wakes the idle engine thread
            deadline = time.monotonic() + 20
            while e.work and time.monotonic() < deadline:  # the loop is busy (blocked here): the engine steps
                time.sleep(0.01)
            assert e.work == 0
            await asyncio.sleep(0.05)
            return wakeups[0] - before
        finally:
            w.stop()

    wakeups = asyncio.run(main())
    assert got == [(n, i) for n in range(9, -1, -1) for i in range(4)]  # every post, in order
    assert wakeups == 1, wakeups


def test_queued_token_batches_of_a_stream_leave_as_one_message():
    from serving.engine.decode import _merge_ready
    from serving.engine.slot import RpcFailure
    from serving.pb import cluster_pb2, common_pb2

    q: asyncio.Queue = asyncio.Queue()
    for i in range(1, 4):
        q.put_nowait(cluster_pb2.TokenBatch(start_position=i, token_ids=[10 + i]))
    q.put_nowait(RpcFailure(None, "x"))
    msg, held = _merge_ready(cluster_pb2.TokenBatch(start_position=0, token_ids=[10]), q)
    assert list(msg.token_ids) == [10, 11, 12, 13] and isinstance(held, RpcFailure)
    q.put_nowait(cluster_pb2.TokenBatch(start_position=2, token_ids=[7], finish_reason=common_pb2.FINISH_REASON_STOP))
    msg, held = _merge_ready(cluster_pb2.TokenBatch(start_position=0, token_ids=[5, 6]), q)
    assert list(msg.token_ids) == [5, 6, 7] and msg.finish_reason == common_pb2.FINISH_REASON_STOP and held is None
