"""How the router carries a request past a tier that fails mid-request (issue 8, transfer faults).
Each function is passed the request and the collaborators it touches (counters, P's pool).

- P fails (UNAVAILABLE: killed, draining) while prefilling or pushing: `next_prefill` takes it
  out of the rotation and picks another healthy P; the router sends that P the same Prefill with
  only the targets whose KV has not arrived. Receivers skip KV they already hold and a second
  push to a tier that already decodes changes nothing, so partial pushes are harmless. No other
  P: the tiers still waiting fail with P's UNAVAILABLE; a tier that has its KV carries on (pdd:
  RLD finishes alone).
- MD's KV transfer fails (MD killed, WAN blackholed past P's no-progress timer, a corrupted
  chunk refused as DATA_LOSS): `main_transfer` counts it (transfer_failed.main.CODE), logs it,
  and an UNAVAILABLE MD leaves the rotation at once (the health loop brings it back). pdd: no
  handoff, RLD finishes the request; pd-cross: the request fails with that status.
- P's KV push to RLD fails in pdd (RLD refused a corrupted chunk, the connection broke) while
  MD's arrives: RLD never decodes without its KV, so `relay_kv_failed` stops forwarding RLD's
  stream and MD takes the request from P's first token (as below; counted relay_kv_failed).
- RLD's stream breaks in pdd (RLD killed): `take_over` waits until P reports MD's KV (or its
  failure), then the router itself sends MD the final token-ID handoff: output positions from 0,
  the tokens the user already has (P's first token if none). MD keys handoffs by (request,
  final), so it is applied once even if RLD's own handoff raced it. The stream then switches to
  MD exactly as after an ordinary handoff (main_took_over).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import grpc

from serving.pb import cluster_pb2
from serving.router import pools
from serving.router.request import Abort, Request
from serving.router.request_state import State

if TYPE_CHECKING:
    import collections


def next_prefill(pool: pools.Pool, counters: collections.Counter, r: Request, failed: pools.Instance,
                 error: grpc.aio.AioRpcError) -> pools.Instance | None:
    """P `failed` broke off a Prefill: -> another healthy P instance of `pool`, or None (not
    retryable, or none left)."""
    if error.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    pools.set_health(failed, False, counters)
    r.prefill_tried.append(failed)
    try:
        nxt = pool.pick(exclude=r.prefill_tried)
    except pools.NoInstance:
        return None
    counters["retry.prefill"] += 1
    r.prefill_extra.append(nxt)
    r.hold(nxt)  # the replacement now carries this request's load (unless it settled)
    print(f"router: P {failed.address} failed ({error.code().name}); prefill retried on {nxt.address}",
          file=sys.stderr, flush=True)
    return nxt


def main_transfer(counters: collections.Counter, r: Request, code: grpc.StatusCode | None, message: str = "") -> None:
    """P reported MD's KV transfer: delivered (code None) or failed."""
    r.main_kv_ok = code is None
    r.main_kv.set()
    if code is None or r.main is None:
        return
    counters[f"transfer_failed.main.{code.name}"] += 1
    print(f"router: KV to MD {r.main.address} failed ({code.name}: {message})", file=sys.stderr, flush=True)
    if code == grpc.StatusCode.UNAVAILABLE:
        pools.set_health(r.main, False, counters)


async def take_over(counters: collections.Counter, r: Request, seen: list[int]):
    """RLD is gone (pdd): -> a TokenBatch that hands the stream to MD, or a sentence on why MD
    cannot take over. Only from RELAY_STREAMING: it moves the request to RELAY_LOST (no RLD
    handoff from now on, and no second take-over)."""
    if r.main is None or r.state is not State.RELAY_STREAMING:
        return "no MD to take over"
    if r.main_given_up:  # released: the request was predicted to end on RLD before a switch (give_up.py)
        return "MD was released (the request was to end on RLD before a switch to MD)"
    r.advance(State.RELAY_LOST)
    counters["relay_lost"] += 1
    await r.main_kv.wait()
    if not r.main_kv_ok or r.first_token is None:
        return "MD cannot take over: its KV did not arrive"
    toks = list(seen) or [r.first_token]
    try:
        ack = await pools.stub(r.main).HandoffTokens(cluster_pb2.HandoffTokensRequest(
            request_id=r.rid, start_position=0, token_ids=toks, final=True), timeout=r.deadline.timeout(30))
    except grpc.aio.AioRpcError as e:
        return f"MD cannot take over: {e.details() or e.code().name}"
    if ack.emit_from > len(toks):  # RLD died after MD applied its final: MD runs from there already
        toks += list(ack.token_ids)
    counters["main_took_over"] += 1
    print(f"router: {r.rid}: RLD lost after {len(seen)} tokens; MD {r.main.address} took over", file=sys.stderr,
          flush=True)
    return cluster_pb2.TokenBatch(start_position=len(seen), token_ids=toks[len(seen):], handed_off=True,
                                  handed_off_at=len(toks))


async def relay_kv_failed(counters: collections.Counter, r: Request, err: Abort) -> None:
    """P reported that RLD's KV did not arrive (pdd): MD takes over from P's first token, or
    the push's error stands. RLD's Decode stream is no longer forwarded (the router releases
    RLD when the request ends)."""
    if r.state is not State.RELAY_STREAMING:  # RLD's stream broke first (its on_error takes over), or it ended
        return
    if r.relay_pump is not None:
        r.relay_pump.cancel()  # no take_over runs (the request would be RELAY_LOST): safe to cancel
    counters[f"relay_kv_failed.{err.code.name}"] += 1
    print(f"router: {r.rid}: KV to RLD failed ({err.code.name}: {err.message}); MD takes over", file=sys.stderr,
          flush=True)
    got = await take_over(counters, r, [])
    r.relay_out.put_nowait(got if isinstance(got, cluster_pb2.TokenBatch)
                           else Abort(err.code, f"{err.message}; {got}", err.stage))
