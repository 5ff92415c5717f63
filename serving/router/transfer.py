"""The router's transfers for one request (`Transfers`, passed the settings, P's pool, the
estimates, the counters and the metrics):

  - `choose_wire`: the KV wire format of each target (the configured one if it declared it,
    else native; `Estimates.wire_format`), named in `explain` when it is not native;
  - `open`: the request's token streams from RLD and MD (subscriptions on each instance's one
    DecodeStream, `decode_streams`, into the request's queues; pdd's RLD stream, if it breaks,
    is taken over by MD), and P's Prefill with its KV targets (RLD from
    its own prefix hit, with the first token; MD from its DRC hit), each in its wire format,
    MD's encoded bytes booked on its link estimate;
  - `_prefill`: P's events: what it cached and its first token, each target's transfer done or
    failed (`recovery`: a failed RLD push -> MD takes over, a failed MD push -> counted, RLD
    finishes or pd-cross fails), MD's KV landing -> RLD's `_handoff` (pdd), a P that fails
    mid-request replaced and only the KV that has not arrived pushed again;
  - `release`: every tier the request touched (but those that freed it themselves,
    `Request.freed`: a P whose Prefill call ended OK, RLD released at the switch; and a tier
    whose stream brought the request's finish), after (if
    the user's stream already ended) the push that still fills MD's DRC, with the link booking
    settled;
  - `sync_main`: a filtered turn's context pushed to MD afterwards, one sync at a time.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc

from serving.pb import cluster_pb2, common_pb2
from serving.router import decode_streams, give_up, pools, recovery
from serving.router.request import Abort, Request, from_rpc, status
from serving.router.request_state import State

if TYPE_CHECKING:
    import collections

    from serving.config import RouterSettings
    from serving.router.estimates import Estimates
    from serving.router.metrics import RouterMetrics

RELEASE_TIMEOUT_S = 30.0  # a background Reserve / Release (context syncs) waits no longer
_REFUSED = grpc.StatusCode.FAILED_PRECONDITION.value[0]  # MD refuses this KV: never decode it anywhere


class Transfers:
    def __init__(self, settings: RouterSettings, prefill_pool: pools.Pool, estimates: Estimates,
                 counters: collections.Counter, metrics: RouterMetrics):
        self.chunk_bytes, self.handoff_threshold = settings.chunk_bytes, settings.handoff_threshold
        self.give_up_main = settings.give_up_main
        self.background_timeout_s = settings.background_timeout_s
        self.prefill_pool, self.estimates, self.counters, self.m = prefill_pool, estimates, counters, metrics
        self._sync_lock = asyncio.Lock()  # background context syncs run one at a time (low priority)
        self.sync_timeout_s, self.max_sync_waiting = settings.sync_timeout_s, settings.max_sync_waiting
        self._sync_waiting = 0  # syncs waiting for the lock

    async def choose_wire(self, r: Request) -> None:
        """The KV wire format of each target `r` pushes to; non-native ones are named in explain."""
        if r.uses_relay:
            r.kv_wire_relay = await self.estimates.wire_format(r.relay)
        if r.uses_main:
            r.kv_wire_main = await self.estimates.wire_format(r.main)
        named = [f"{who} {fmt}" for who, fmt, used in (("RLD", r.kv_wire_relay, r.uses_relay),
                                                       ("MD", r.kv_wire_main, r.uses_main)) if used and fmt != "native"]
        if named:
            r.explain += "; KV wire " + ", ".join(named)

    async def open(self, r: Request) -> None:
        """RLD's and MD's Decode streams, then P's Prefill pushing KV to both at once."""
        targets = []
        hold = r.stream_interval if r.interval_at_source else (1, 0.0)
        if r.uses_relay:  # the tiers' tokens come on their instance's one DecodeStream (decode_streams.py)
            lost = self._relay_lost(r) if r.pipeline == common_pb2.PIPELINE_PDD else None
            r.relay_pump = decode_streams.subscribe(r.relay, r.rid, r.relay_out, "relay", lost, hold)
            r.tasks.append(r.relay_pump)
            targets.append(cluster_pb2.KVTarget(address=r.relay.kv_address, start=r.cached_relay,
                                                role=common_pb2.ROLE_RELAY, include_first_token=True,
                                                kv_wire=r.kv_wire_relay))
        if r.uses_main:
            r.tasks.append(decode_streams.subscribe(r.main, r.rid, r.main_out, "main", hold=hold))
            targets.append(cluster_pb2.KVTarget(address=r.main.kv_address, start=r.cached_main,
                                                role=common_pb2.ROLE_MAIN, include_first_token=not r.uses_relay,
                                                kv_wire=r.kv_wire_main))
            r.link = self.estimates.link(r.main)
            per_token = await self.estimates.wire_bytes_per_token(r.prefill, r.kv_wire_main)
            r.planned = int((len(r.prompt) - r.cached_main) * per_token)
            r.link.start(r.planned)
        preq = cluster_pb2.PrefillRequest(spec=r.spec, targets=targets, chunk_bytes=self.chunk_bytes)
        r.prefill_task = asyncio.create_task(self._prefill(r, preq))
        r.tasks.append(r.prefill_task)

    async def _prefill(self, r: Request, preq: cluster_pb2.PrefillRequest) -> None:
        """P's events for one request. A P that fails mid-request is replaced and only the KV
        that has not arrived is pushed again (recovery.next_prefill)."""
        prefill, reported = r.prefill, set()  # the P serving it now; roles whose transfer P reported
        try:
            while True:
                try:
                    async for ev in pools.stub(prefill).Prefill(preq, timeout=r.deadline.timeout()):
                        if ev.HasField("prefilled"):
                            r.cached_prefill, r.prefill_ms = ev.prefilled.num_cached, ev.prefilled.prefill_ms
                            r.queued_ms += ev.prefilled.queued_ms
                            self.m.page_wait("prefill", ev.prefilled.queued_ms)
                            r.first_token = ev.prefilled.first_token
                            if ev.prefilled.HasField("first_logprob"):
                                r.first_logprob = ev.prefilled.first_logprob
                            continue
                        reported.add(ev.transfer_done.role)
                        self._transfer_done(r, ev.transfer_done)
                    r.freed.append(prefill)  # its handler's end freed the request on P: no Release needed
                    return
                except grpc.aio.AioRpcError as e:
                    left = [t for t in preq.targets if t.role not in reported]
                    nxt = recovery.next_prefill(self.prefill_pool, self.counters, r, prefill, e) if left else None
                    if nxt is None:
                        for t in left:
                            (r.relay_out if t.role == common_pb2.ROLE_RELAY else r.main_out).put_nowait(
                                from_rpc(e, "prefill"))
                        return
                    prefill = nxt
                    preq = cluster_pb2.PrefillRequest(spec=preq.spec, targets=left, chunk_bytes=preq.chunk_bytes)
        finally:
            r.main_kv.set()  # P reported nothing more: whoever waits for MD's KV stops (main_kv_ok stays)

    def _transfer_done(self, r: Request, d: cluster_pb2.TransferDone) -> None:
        err = Abort(status(d.code), d.error, "transfer") if d.code else None
        pdd = r.pipeline == common_pb2.PIPELINE_PDD
        self.estimates.learn_wire(r.kv_wire_relay if d.role == common_pb2.ROLE_RELAY else r.kv_wire_main, d)
        if d.role == common_pb2.ROLE_RELAY:
            r.bytes_relay = d.bytes
            if err and pdd and r.main is not None and d.code != _REFUSED:
                # RLD never got its KV (it decodes nothing without it): MD serves it all
                r.tasks.append(asyncio.create_task(recovery.relay_kv_failed(self.counters, r, err)))
            elif err:
                r.relay_out.put_nowait(err)
            return
        r.bytes_main, r.main_kv_ms = d.bytes, d.ms
        self.m.wan_bytes(d.bytes)
        if r.link is not None:
            r.link.done(r.planned, d.bytes, (d.wire_ms or d.ms) / 1e3, ok=not err, total_seconds=d.ms / 1e3)
            r.link = None  # the booking is settled
        recovery.main_transfer(self.counters, r, err and err.code, d.error)
        if err and r.pipeline == common_pb2.PIPELINE_PD_CROSS:
            r.main_out.put_nowait(err)
        elif err and d.code == _REFUSED:
            r.relay_out.put_nowait(err)  # MD refuses this KV: never decode it anywhere
        elif not err and pdd and r.state is State.RELAY_STREAMING:  # RLD still serves: hand off to MD
            if not self._give_main_up(r, 0.0):  # unless it would end before the switch (give_up.py)
                r.handoff_t0 = time.perf_counter()
                r.handoff_task = asyncio.create_task(self._handoff(r))
                r.tasks.append(r.handoff_task)

    def _relay_lost(self, r: Request):
        """on_error of RLD's stream (pdd): MD takes the request over, or the error stands."""
        async def on_error(err: Abort, seen: list[int]):
            why = await recovery.take_over(self.counters, r, seen)
            if isinstance(why, cluster_pb2.TokenBatch):
                return why
            return Abort(err.code, f"{err.message}; {why}", "relay")
        return on_error

    def stop_handoff(self, r: Request) -> bool:
        """A chunked handoff running, RLD still the source: give MD up if the request is now
        predicted to end before the switch (-> True: the stream stays on RLD)."""
        if not r.handoff_t0 or r.main_given_up or r.mode != common_pb2.HANDOFF_MODE_CHUNKED:
            return bool(r.main_given_up)
        return self._give_main_up(r, time.perf_counter() - r.handoff_t0)

    def _give_main_up(self, r: Request, elapsed: float) -> bool:
        """Gives MD up (no handoff, or the running one cancelled; MD released keeping the
        prompt in its DRC) when `give_up.SwitchClock.due`; -> whether it did."""
        if not self.give_up_main:
            return False
        pace = give_up.relay_pace(r.relay_after, r.relay_t0, r.relay_t1, self.estimates.speed(r.relay).value)
        clock = self.estimates.switch_clock(r.main)
        if not clock.due(give_up.remaining_seconds(r.max_tokens, len(r.tokens), pace), elapsed):
            return False
        clock.gave_up()
        r.main_given_up = "stopped" if r.handoff_t0 else "skipped"
        self.counters[f"handoff.given_up.{r.main_given_up}"] += 1
        self.m.gave_up(r.main_given_up)
        if r.handoff_task is not None:
            r.handoff_task.cancel()
        r.tasks.append(asyncio.create_task(self._release_main(r)))
        return True

    def learn_handoff(self, r: Request, switched: bool) -> None:
        """A handoff's outcome for its MD's SwitchClock: the stream switched now, or the request
        finished on RLD without a switch (a handoff given up teaches nothing more)."""
        if r.handoff_t0 and not r.main_given_up and r.main is not None:
            clock = self.estimates.switch_clock(r.main)
            seconds = time.perf_counter() - r.handoff_t0
            clock.switched(seconds) if switched else clock.unswitched(seconds)

    async def _release_main(self, r: Request) -> None:
        """MD given up: released now (its DRC keeps the context); the request's final release skips it."""
        try:
            await pools.stub(r.main).Release(cluster_pb2.ReleaseRequest(request_id=r.rid, cache=True, cancel=True),
                                             timeout=RELEASE_TIMEOUT_S)
            r.freed.append(r.main)
        except grpc.aio.AioRpcError:
            pass  # the request's final release tries again

    async def _handoff(self, r: Request) -> None:
        try:
            h = await pools.stub(r.relay).Handoff(cluster_pb2.HandoffRequest(
                request_id=r.rid, main_address=r.main.kv_address, mode=r.mode, threshold=self.handoff_threshold),
                timeout=r.deadline.timeout())
            if h.handed_off:
                r.handoff_tokens, r.handoff_chunks = h.tokens, h.chunks
                self.m.handoff(h.chunks)
                self.counters["handoff." + ("chunked" if h.chunks > 1 else "one-shot")] += 1
        except grpc.aio.AioRpcError:
            pass  # RLD keeps decoding and finishes the request itself

    async def release(self, r: Request, pending: asyncio.Task | None = None) -> None:
        """Releases every tier `r` touched (idempotent on theirs), after `pending` (P's push still
        filling MD's DRC) finished or `background_timeout_s` passed. A P whose Prefill call ended
        OK is not asked: its handler freed the request when the call ended (one RPC less per request);
        nor is a tier that sent the request's finish (it closed its slot and freed the sequence then)."""
        if pending is not None:
            try:
                await asyncio.wait_for(pending, timeout=self.background_timeout_s)
            except (TimeoutError, asyncio.CancelledError):
                pass
        if r.link is not None:  # the booking P never reported
            r.link.done(r.planned, 0, 0.0, ok=False)
            r.link = None
        req = cluster_pb2.ReleaseRequest(request_id=r.rid, cache=True, cancel=True)
        done_at = [t.mux.inst for t in r.tasks if isinstance(t, decode_streams.Subscription) and t.finished]
        insts = [i for i in r.touched() if i not in r.freed and i not in done_at]  # freed by themselves: RLD at
        # the switch, P when its call ended OK, a tier that finished the request (it closed and freed it)
        await asyncio.gather(*(pools.stub(i).Release(req) for i in insts), return_exceptions=True)

    async def sync_main(self, r: Request) -> None:
        """A filtered (pd-local) turn of a session: push its context's KV to MD anyway, after the
        user's request finished and one sync at a time, so the session's next turn hits MD's DRC.
        Bounded: at most `max_sync_waiting` wait behind the running one (more are dropped), and
        each gives up after `sync_timeout_s` (both counted)."""
        if self._sync_waiting >= self.max_sync_waiting:
            self.counters["sync_main.dropped"] += 1
            return
        self._sync_waiting += 1
        try:
            await self._sync_lock.acquire()
        finally:
            self._sync_waiting -= 1
        try:
            await asyncio.wait_for(self._sync_one(r), self.sync_timeout_s)
        except TimeoutError:
            self.counters["sync_main.timed_out"] += 1
        finally:
            self._sync_lock.release()

    async def _sync_one(self, r: Request) -> None:
        """One context sync: Reserve on MD, P prefills (its prefix cache) and pushes the KV, both released."""
        rid, context = f"sync-{r.rid}", r.prompt + r.tokens[:-1]
        spec = cluster_pb2.SequenceSpec(request_id=rid, prompt=context, sampling=r.spec.sampling, max_tokens=1,
                                        stop_token_ids=r.spec.stop_token_ids)
        main, prefill = pools.stub(r.main_choice), pools.stub(r.prefill)
        ok, link, planned = False, self.estimates.link(r.main_choice), 0
        try:
            cached = (await main.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=True),
                                         timeout=RELEASE_TIMEOUT_S)).cached_tokens
            fmt = await self.estimates.wire_format(r.main_choice)
            planned = int((len(context) - cached) * await self.estimates.wire_bytes_per_token(r.prefill, fmt))
            link.start(planned)
            target = cluster_pb2.KVTarget(address=r.main_choice.kv_address, start=cached, role=common_pb2.ROLE_MAIN,
                                          kv_wire=fmt)
            async for ev in prefill.Prefill(cluster_pb2.PrefillRequest(spec=spec, targets=[target],
                                                                       chunk_bytes=self.chunk_bytes)):
                if ev.HasField("transfer_done"):
                    d = ev.transfer_done
                    self.m.wan_bytes(d.bytes)
                    self.estimates.learn_wire(fmt, d)
                    ok = not d.code
                    link.done(planned, d.bytes, (d.wire_ms or d.ms) / 1e3, ok, total_seconds=d.ms / 1e3)
                    planned = 0
        except grpc.aio.AioRpcError:
            pass
        finally:
            if planned:
                link.done(planned, 0, 0.0, ok=False)
            self.counters["sync_main." + ("done" if ok else "failed")] += 1
            await asyncio.gather(main.Release(cluster_pb2.ReleaseRequest(request_id=rid, cache=ok, cancel=True),
                                              timeout=RELEASE_TIMEOUT_S),
                                 prefill.Release(cluster_pb2.ReleaseRequest(request_id=rid, cache=True,
                                                                            cancel=True), timeout=RELEASE_TIMEOUT_S),
                                 return_exceptions=True)
