"""RPCs every engine service (P, RLD, MD) answers the same way: Info and MatchPrefix.

A mixin: the service provides `self.worker` (EngineWorker), `self.engine` and `self.info`
(the static ServiceInfo fields)."""

from __future__ import annotations

import grpc

from serving.pb import cluster_pb2


def engine_info(e) -> tuple[int, int, str]:
    """Engine thread: (pages held by requests, sequences, integrity error or "")."""
    try:
        e.check_integrity()
        err = ""
    except AssertionError as x:
        err = str(x) or "check_integrity failed"
    return e.num_pages_active, len(e.seqs), err


class EngineRpcs:
    async def Info(self, request, context):
        pages, n, err = await self.worker.call(engine_info)
        return cluster_pb2.ServiceInfo(**self.info, pages_active=pages, requests=n, integrity_error=err)

    async def MatchPrefix(self, request, context):
        """How many leading pages of a prompt this engine's prefix cache holds, by chained hashes."""
        S = self.engine.config.page_size
        if request.page_size != S:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"page hashes must be computed at page size {S}, got {request.page_size}")
        pages = await self.worker.call(lambda e: e.prefix_hit_by_hashes(list(request.page_hashes)))
        return cluster_pb2.MatchPrefixResponse(matched_pages=pages, matched_tokens=pages * S, page_size=S)
