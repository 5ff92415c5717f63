"""RPCs every engine service (P, RLD, MD) answers the same way: Info and MatchPrefix.

Plain functions: a service's `Info` and `MatchPrefix` pass them its engine worker and what
they read (the static ServiceInfo fields, the engine's page size).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from serving.kvwire import ACCEPTED
from serving.pb import cluster_pb2, common_pb2

if TYPE_CHECKING:
    from serving.engine.worker import EngineWorker


def engine_info(e, check=None) -> tuple[int, int, str]:
    """Engine thread: (pages held by requests, sequences, integrity error or ""); `check`, the
    service's own integrity check (RLD's and MD's slot table), runs after the engine's."""
    try:
        e.check_integrity()
        if check is not None:
            check()
        err = ""
    except AssertionError as x:
        err = str(x) or "check_integrity failed"
    return e.num_pages_active, len(e.seqs), err


async def service_info(worker: EngineWorker, fields: dict, check=None) -> cluster_pb2.ServiceInfo:
    """Info: the static `fields` (role, model, page size...), the engine's occupancy now and
    the integrity error of the engine or of `check` (engine_info).
    RLD and MD declare the KV wire formats their PushKV decodes (all of this build's, unless
    `fields` names fewer: then the service's KVReceiver must be given the same)."""
    pages, n, err = await worker.call(engine_info, check)
    if fields.get("role") != common_pb2.ROLE_PREFILL and "kv_wire_formats" not in fields:
        fields = {**fields, "kv_wire_formats": ACCEPTED}
    return cluster_pb2.ServiceInfo(**fields, pages_active=pages, requests=n, integrity_error=err)


async def match_prefix(worker: EngineWorker, page_size: int, request, context) -> cluster_pb2.MatchPrefixResponse:
    """MatchPrefix: how many leading pages of a prompt the engine's prefix cache holds, by chained hashes."""
    S = page_size
    if request.page_size != S:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"page hashes must be computed at page size {S}, got {request.page_size}")
    pages = await worker.call(lambda e: e.prefix_hit_by_hashes(list(request.page_hashes)))
    return cluster_pb2.MatchPrefixResponse(matched_pages=pages, matched_tokens=pages * S, page_size=S)
