"""The router's deadlines are bounded (serving/router/admission.py, `[router] max_deadline_s`): a
client's deadline past the maximum, on the gRPC Generate or the in-process entry point, is cut to
it before the request is read; a config whose maximum is below its default is refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pddjax.errors import UserError
from pddjax.model.config import TINY
from serving.config import RouterSettings
from serving.pb import router_pb2
from serving.router import service as router_service
from serving.router.admission import Deadline
from serving.router.request import Abort
from serving.router.service import RouterService

pytestmark = pytest.mark.timeout(30)


class Context:
    """A gRPC servicer context whose client asked for `remaining` seconds."""

    def __init__(self, remaining: float | None):
        self.remaining, self.aborted = remaining, None

    def time_remaining(self):
        return self.remaining

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.RpcError(details)


def test_deadline_of_cuts_a_clients_deadline_to_the_maximum():
    assert Deadline.of(Context(1e300), 600.0, 1800.0).remaining() <= 1800.0
    assert Deadline.of(Context(None), 600.0, 1800.0).remaining() <= 600.0
    assert 0 < Deadline.of(Context(5.0), 600.0, 1800.0).remaining() <= 5.0
    assert Deadline.capped(None, 30.0).remaining() <= 30.0


def test_max_deadline_below_the_default_or_infinite_is_refused():
    with pytest.raises(UserError, match="max_deadline_s"):
        RouterSettings(default_deadline_s=600.0, max_deadline_s=60.0)
    with pytest.raises(UserError, match="max_deadline_s"):
        RouterSettings(max_deadline_s=float("inf"))


def test_generate_and_the_in_process_entry_point_cap_the_clients_deadline(monkeypatch):
    seen = []

    async def read(r, req, cfg, tok, handoff, *settings):
        seen.append(r.deadline.remaining())
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "seen")

    monkeypatch.setattr(router_service.validate, "read", read)
    svc = RouterService(RouterSettings(prefill=["127.0.0.1:1"], relay=["127.0.0.1:2"], main=["127.0.0.1:3"],
                                       max_deadline_s=900.0), TINY, None)

    async def main():
        ctx = Context(1e300)
        with pytest.raises(grpc.RpcError):
            async for _ in svc.Generate(router_pb2.GenerateRequest(), ctx):
                pass
        assert ctx.aborted == (grpc.StatusCode.INVALID_ARGUMENT, "seen")
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in svc.generate_local(router_pb2.GenerateRequest(), timeout_s=1e300):
                pass

    asyncio.run(main())
    assert len(seen) == 2 and all(0 < s <= 900.0 for s in seen), seen
