"""Hold (RLD): the router pauses a decoding request while the user waits for MD, and resumes it.

Once MD agrees with the user's tokens and is close behind, the router holds RLD's batches back
from the user until MD covers every token the user has (serving/router/ahead.py). RLD decoding on
meanwhile makes tokens the user will most likely never see, and where RLD and MD share cores (one
machine, as in `pddjax up`) its steps slow MD's, which the user waits for. So the router asks RLD
to hold the request: its sequence is paused (no rows in the next steps) while its slot stays
DECODING, its stream open and its pages kept; `hold = false` decodes on (MD differed or was late,
and RLD keeps the request), as does the router's Release at the switch end it. A request that is
not DECODING here (unknown, finished, its KV still to come, or paused for a one-shot handoff) is
left as it is and answered found = false.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving.engine.slot import SlotState
from serving.pb import cluster_pb2

if TYPE_CHECKING:
    from serving.engine.slot import SlotTable
    from serving.engine.worker import EngineWorker


def hold(e, slots: SlotTable, rid: str, on: bool) -> bool:
    """Engine thread: pause (`on`) or resume the decoding of `rid` -> whether it is DECODING here."""
    slot, seq = slots.get(rid), e.seqs.get(rid)
    if slot is None or slot.state is not SlotState.DECODING or seq is None or seq.finish_reason:
        return False
    seq.paused = on
    return True


async def serve(worker: EngineWorker, slots: SlotTable, request: cluster_pb2.HoldRequest) -> cluster_pb2.HoldResponse:
    """The Hold RPC: applied on the engine thread ahead of ordinary commands (urgent)."""
    slots.touch(request.request_id)
    found = await worker.call(hold, slots, request.request_id, request.hold, urgent=True)
    return cluster_pb2.HoldResponse(found=found)
