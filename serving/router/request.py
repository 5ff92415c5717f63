"""The router's per-request types and stream plumbing (no policy, no gRPC servicer):
pipeline names, the error a request fails with (`_Abort`), what was planned (`_Plan`), what
Generate knows whatever stage failed (`_Job`), a request's transfer and timing state
(`_State`), and the pump that turns a tier's token stream into queue items."""

from __future__ import annotations

import asyncio

import grpc

from serving.pb import common_pb2
from serving.router.admission import Deadline

P = common_pb2
PIPELINE_NAMES = {P.PIPELINE_AUTO: "auto", P.PIPELINE_PDD: "pdd", P.PIPELINE_PD_CROSS: "pd-cross",
                  P.PIPELINE_PD_LOCAL: "pd-local"}
_PIPELINES = {v: k for k, v in PIPELINE_NAMES.items()}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, stage: str = ""):
        super().__init__(message)
        self.code, self.message, self.stage = code, message, stage  # stage: where it failed (metrics)


def _from_rpc(e: grpc.aio.AioRpcError, who: str) -> _Abort:
    return _Abort(e.code(), e.details() or f"{who} failed with {e.code().name}", who)


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class _Plan:
    def __init__(self):
        self.p = self.rld = self.md = None  # pools.Instance
        self.hit_p = self.hit_md = 0
        self.pipeline, self.reason, self.explain, self.sync_main = P.PIPELINE_AUTO, "", "", False


class _Job:
    """What Generate needs to know about its request, whatever stage it failed in."""

    def __init__(self):
        self.stage = "validate"  # validate | admission | plan | reserve | stream (failure metrics)
        self.admitted = False  # holds an admission slot (released by Generate)


class _State:
    def __init__(self):
        self.cached_p = self.cached_md = self.cached_rld = 0
        self.bytes_rld = self.bytes_md = 0
        self.prefill_ms = self.md_ms = 0.0
        self.ttft = None
        self.handoff_at = None
        self.handoff_tokens = self.handoff_chunks = 0
        self.link, self.planned, self.link_done = None, 0, False  # MD's link estimator, bytes planned on it
        self.relay_t0 = self.relay_t1 = 0.0  # first and last relay batch (perf_counter)
        self.relay_after = 0  # relay tokens after the first batch
        self.finished = False  # the user's stream has its last message
        self.deadline = Deadline(None)  # the client's: every downstream RPC's timeout
        self.first_token = None  # P's (router_recovery: MD taking over before RLD sent any token)
        self.md_kv, self.md_kv_ok = asyncio.Event(), False  # P reported MD's KV transfer (delivered?)
        self.relay_lost = False  # RLD's stream broke: MD took over (or tried); no RLD handoff
        self.relay_pump = None  # the task forwarding RLD's Decode stream (pdd, pd-local)
        self.p_tried, self.p_extra = [], []  # P instances that failed / replaced them (router_recovery)
        self.held: list = []  # instances this request loads (their `inflight` counts it) until it settles


def _expire(*queues) -> None:
    """The client's deadline passed: the stream fails with DEADLINE_EXCEEDED (then releases all)."""
    for q in queues:
        q.put_nowait(_Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed before it finished"))


def _terminal(item) -> bool:
    return isinstance(item, _Abort) or bool(item.finish_reason) or item.handed_off


async def _pump(call, q: asyncio.Queue, who: str, on_error=None) -> None:
    """A tier's token stream into `q`; a failure becomes an _Abort, or what `on_error(err, tokens
    forwarded so far)` makes of it (pdd's RLD: MD taking over)."""
    seen: list[int] = []
    try:
        async for batch in call:
            q.put_nowait(batch)
            seen += batch.token_ids
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            err = _from_rpc(e, who)
            q.put_nowait(await on_error(err, seen) if on_error else err)
