"""The reservation leases of RLD and MD: a loop on the event loop that drops what nobody will use.

  - a reservation with no open Decode stream and no traffic (PushKV, Handoff*) for
    PDDJAX_LEASE_SECONDS ends DEADLINE_EXCEEDED and frees its pages: an aborted transfer or a
    vanished router never leaks a slot;
  - one still waiting for its KV (or its handoff) with no such traffic for PDDJAX_KV_WAIT_SECONDS
    is dropped even with its stream open;
  - a slot alive LINGER_LEASES leases is logged once with its state (legitimate for a long
    generation; a leak shows up here first).

One slot's failing check is logged and never ends the loop.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TYPE_CHECKING

import grpc

from pddjax import env
from serving.engine.slot import WAITING, RpcFailure, Slot

if TYPE_CHECKING:
    from serving.engine.slot import SlotTable
    from serving.engine.worker import EngineWorker

LINGER_LEASES = 3  # a slot alive this many leases is logged once with its state


class Leases:
    """The lease loop of one Decode service (`role` names it in messages)."""

    def __init__(self, role: str, worker: EngineWorker, slots: SlotTable):
        self.role, self.worker, self.slots = role, worker, slots

    async def run(self) -> None:
        while True:
            lease_s, kv_wait_s = env.LEASE_SECONDS.get(), env.KV_WAIT_SECONDS.get()
            await asyncio.sleep(min(5.0, lease_s / 4, kv_wait_s / 4))
            now = time.monotonic()
            for slot in self.slots:
                try:
                    await self._check(slot, now, lease_s, kv_wait_s)
                except Exception as exc:  # noqa: BLE001  (one slot's failure never ends the other leases)
                    print(f"{self.role}: the lease check of {slot.request_id} failed ({type(exc).__name__}: "
                          f"{str(exc)[:160]})", file=sys.stderr, flush=True)

    async def _check(self, slot: Slot, now: float, lease_s: float, kv_wait_s: float) -> None:
        """One slot's lease: expired, its KV overdue, or logged once when it lingers."""
        idle = now - slot.touched
        if not slot.closed and slot.streams == 0 and idle > lease_s:
            failure = RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"the reservation of {slot.request_id} on {self.role} expired "
                                 f"after {lease_s:.0f} s without traffic")
            await self.worker.call(self._expire, slot, failure)
        elif slot.state in WAITING and idle > kv_wait_s:
            # an open stream keeps a reservation, but not one whose KV (or handoff) never comes
            failure = RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"no KV for {slot.request_id} reached {self.role} within "
                                 f"{kv_wait_s:.0f} s; its reservation is dropped")
            await self.worker.call(self._expire, slot, failure)
        elif not slot.closed and not slot.reported and now - slot.born > LINGER_LEASES * lease_s:
            slot.reported = True
            print(f"{self.role}: {slot.request_id} alive {now - slot.born:.0f} s "
                  f"({await self.worker.call(_describe, slot)})", file=sys.stderr, flush=True)

    def _expire(self, e, slot: Slot, failure: RpcFailure) -> None:
        """Engine thread: an expired reservation ends with `failure` and frees its pages. Should the
        close raise, the engine's sequence is released once more here (the slot has left the table:
        SlotTable.close), and the exception goes on to the lease loop's log line."""
        try:
            self.slots.close(slot, failure, cache=False)
        finally:
            rid, owner = slot.request_id, self.slots.get(slot.request_id)
            if slot.closed and rid in e.seqs and (owner is None or owner is slot):
                e.release(rid, cache=False)


def _describe(e, slot: Slot) -> str:
    """Engine thread: one line of a slot's state (diagnostics of a request that lingers)."""
    seq = e.seqs.get(slot.request_id)
    state = "no sequence" if seq is None else (
        f"paused={seq.paused} kv={seq.pages.num_tokens}/{len(seq.prompt)} generated={len(seq.generated)} "
        f"pending={seq.num_pending} finish={seq.finish_reason}")
    return (f"state={slot.state.name} streams={slot.streams} emit_from={slot.emit_from} "
            f"idle {time.monotonic() - slot.touched:.0f} s; {state}")
