"""What the engine thread does when a step raises (issue 17, defect 2): never retry it.

The step's sequences fail (the service ends each request with INTERNAL and this sentence, and
frees its pages), the rest of the engine serves on, the fault is counted (the snapshot's
`faults` -> `pddjax_engine_faults_total`), and FAULTS_TO_UNHEALTHY faults within FAULT_WINDOW_S
flip the service's health to NOT_SERVING, so the router routes around the instance; health
comes back once FAULT_WINDOW_S passed without a fault.
"""

from __future__ import annotations

import collections
import time
import traceback
from collections.abc import Callable

FAULTS_TO_UNHEALTHY = 3
FAULT_WINDOW_S = 60.0


class StepFaults:
    """The fault record of one engine thread. `on_fault(engine, seq_ids, sentence)` (engine
    thread) ends those requests in the service's terms; `post_health(serving: bool)` reaches
    the event loop (grpc.health.v1)."""

    def __init__(self, name: str):
        self.name = name
        self.total = 0
        self.recent: collections.deque[float] = collections.deque()
        self.unhealthy = False
        self.on_fault: Callable | None = None
        self.post_health: Callable[[bool], None] | None = None

    def failed(self, engine, exc: BaseException) -> None:
        """Engine thread: `engine.step()` raised `exc`. Fail its rows (or, when it failed before
        choosing rows, every sequence with pending work), so the next step is not the same one."""
        traceback.print_exc()
        rows = list(getattr(engine, "step_rows", None) or [rid for rid, s in engine.seqs.items() if s.num_pending])
        sentence = f"the {self.name} engine step failed ({type(exc).__name__}: {str(exc)[:160]})"
        now = time.monotonic()  # counted (and health flipped) before the failed requests hear of it
        self.total += 1
        self.recent.append(now)
        while self.recent and now - self.recent[0] > FAULT_WINDOW_S:
            self.recent.popleft()
        if len(self.recent) >= FAULTS_TO_UNHEALTHY and not self.unhealthy:
            self.unhealthy = True
            print(f"{self.name}: {len(self.recent)} engine faults in {FAULT_WINDOW_S:.0f} s: NOT_SERVING",
                  flush=True)
            if self.post_health is not None:
                self.post_health(False)
        if self.on_fault is not None:
            try:
                self.on_fault(engine, rows, sentence)
            except Exception:  # noqa: BLE001  (the release below still runs)
                traceback.print_exc()
        for rid in rows:  # whatever the service did not release: never the same step again
            if rid in engine.seqs:
                engine.release(rid, cache=False)
        engine.step_rows = None

    def tick(self) -> float | None:
        """Engine thread, every loop: health back after a quiet window. -> seconds until the
        next check (the thread must wake for it), or None."""
        if not self.unhealthy:
            return None
        quiet = time.monotonic() - (self.recent[-1] if self.recent else 0.0)
        if quiet < FAULT_WINDOW_S:
            return FAULT_WINDOW_S - quiet
        self.unhealthy = False
        self.recent.clear()
        print(f"{self.name}: no engine fault for {FAULT_WINDOW_S:.0f} s: SERVING again", flush=True)
        if self.post_health is not None:
            self.post_health(True)
        return None
