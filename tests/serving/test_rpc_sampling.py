"""Sampling parameters as they come off the wire (`rpc.sampling_from_pb`): top_p = 0 is proto3's
unset and means 1.0 (off); every other out-of-range value is refused with INVALID_ARGUMENT and
one sentence, by the router's Generate and by the tiers' Reserve and Prefill alike. Expected
values are literals and gRPC statuses, never built through the conversion under test."""

from __future__ import annotations

import math

import grpc
import pytest

from pddjax.model.config import TINY
from serving import rpc
from serving.client import make_request
from serving.engine.decode import DecodeService
from serving.engine.prefill import PrefillService
from serving.pb import cluster_pb2, common_pb2
from serving.router import validate
from serving.router.request import Abort, Request
from tests.support.fake_peers import FakePeers
from tests.support.inprocess import Ctx, Refused

pytestmark = pytest.mark.timeout(120)

# (sampling fields, the word the refusal names)
REFUSED = [
    ({"top_p": -0.5}, "top-p"), ({"top_p": -math.inf}, "top-p"), ({"top_p": math.nan}, "top-p"),
    ({"top_p": math.inf}, "top-p"), ({"top_p": 1.5}, "top-p"),
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": -1.0}, "temperature"), ({"top_k": 2**31}, "top-k"),
]
IDS = [",".join(f"{k}={v}" for k, v in f.items()) for f, _ in REFUSED]


def test_top_p_zero_is_unset_and_reads_as_one():
    assert rpc.sampling_from_pb(common_pb2.Sampling(top_p=0.0)).top_p == 1.0
    assert rpc.sampling_from_pb(common_pb2.Sampling()).top_p == 1.0
    assert rpc.sampling_from_pb(common_pb2.Sampling(top_p=0.5)).top_p == 0.5


@pytest.mark.parametrize("fields, word", REFUSED, ids=IDS)
def test_out_of_range_sampling_is_not_rewritten(fields, word):
    """The conversion keeps what was sent: a negative or NaN top_p is no longer read as 1.0."""
    params = rpc.sampling_from_pb(common_pb2.Sampling(**fields))
    assert params.top_p != 1.0 or "top_p" not in fields, params
    with pytest.raises(ValueError, match=word):
        params.validate()


def _read(**sampling) -> Request:
    """The router's first stage of Generate on a token-id prompt."""
    import asyncio

    r = Request()
    asyncio.run(validate.read(r, make_request([5, 6, 7], max_tokens=4, **sampling), TINY, None, "chunked"))
    return r


@pytest.mark.parametrize("fields, word", REFUSED, ids=IDS)
def test_the_router_refuses_out_of_range_sampling(fields, word):
    with pytest.raises(Abort) as e:
        _read(**fields)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert word in str(e.value) and str(e.value).count(". ") == 0, str(e.value)


def test_the_router_sends_the_tiers_top_p_one_for_zero():
    assert _read(top_p=0.0).spec.sampling.top_p == 1.0
    assert _read(top_p=0.25).spec.sampling.top_p == 0.25


@pytest.mark.parametrize("fields, word", REFUSED, ids=IDS)
def test_the_tiers_refuse_out_of_range_sampling(fields, word):
    """Reserve (RLD / MD) and Prefill (P) check before they touch their engine (none here)."""
    import asyncio

    spec = cluster_pb2.SequenceSpec(request_id="r", prompt=[5, 6, 7], max_tokens=4,
                                    sampling=common_pb2.Sampling(**fields))

    async def refusals():
        out = []
        for call in (DecodeService("relay", None, TINY, {}).Reserve(cluster_pb2.ReserveRequest(spec=spec), Ctx()),
                     PrefillService(None, TINY, {}).Prefill(cluster_pb2.PrefillRequest(spec=spec), Ctx())):
            with pytest.raises(Refused) as e:
                await _drain(call)
            out.append(e.value)
        return out

    for refused in asyncio.run(refusals()):
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and word in refused.message, refused.message


async def _drain(call):
    if hasattr(call, "__aiter__"):  # Prefill streams its events
        async for _ in call:
            pass
    else:
        await call


@pytest.fixture(scope="module")
def router_on_fake_peers(tmp_path_factory):
    """A real router process against fake peers (their Reserve answers "fake peer: full")."""
    from serving.stack.up import stop_all

    peers = FakePeers()
    try:
        d = str(tmp_path_factory.mktemp("rpc_sampling"))
        with open(f"{d}/router.log", "ab") as log:
            child = peers.router(d, log=log, wan_probe=False)
        try:
            with grpc.insecure_channel(child.address) as ch:
                yield ch
        finally:
            stop_all([child])
    finally:
        peers.close()


def _generate(channel, req) -> tuple[grpc.StatusCode, str]:
    call = channel.unary_stream("/pddjax.v1.Router/Generate", request_serializer=type(req).SerializeToString,
                                response_deserializer=lambda b: b)
    try:
        for _ in call(req, timeout=30):
            pass
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("fields, word", REFUSED, ids=IDS)
def test_generate_answers_invalid_argument_on_the_wire(router_on_fake_peers, fields, word):
    code, details = _generate(router_on_fake_peers, make_request([5, 6, 7], max_tokens=4, pipeline="pdd", **fields))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and word in details, (code, details)


def test_generate_with_top_p_zero_gets_past_validation(router_on_fake_peers):
    """top_p = 0 is not refused: the request reaches the tiers (whose fake pools are full)."""
    code, details = _generate(router_on_fake_peers, make_request([5, 6, 7], max_tokens=4, pipeline="pdd", top_p=0.0))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "fake peer: full" in details, (code, details)
