"""Fuzzing every RPC of P and RLD/MD (issue 8, point 1): arbitrary well-formed protobuf messages
and raw malformed bytes. Every call ends with OK or a deliberate status (never UNKNOWN or
INTERNAL, i.e. never an unhandled exception), the services still serve, their integrity checks
pass, and once every fuzzed request id is released no KV page stays held."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.pb import cluster_pb2, cluster_pb2_grpc
from tests.serving_stack import Stack

pytestmark = pytest.mark.timeout(600)
STACK = {"model": "tiny", "platform": "cpu",
         "engine": {"dtype": "float32", "page_size": 16, "num_pages": 64, "max_step_tokens": 64, "max_rows": 4}}
SERVICES = {"prefill": cluster_pb2.DESCRIPTOR.services_by_name["Prefill"],
            "main": cluster_pb2.DESCRIPTOR.services_by_name["Decode"]}
DELIBERATE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
              grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS,
              grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
              grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}
REQUEST_IDS = ["r0", "r1", "r2", ""]  # a few ids, so calls meet each other's state


def _repeated(f) -> bool:
    r = getattr(f, "is_repeated", None)  # protobuf >= 6 dropped FieldDescriptor.label
    return bool(r) if r is not None else f.label == F.LABEL_REPEATED


def _scalar(f):
    t = f.type
    if t in (F.TYPE_STRING,):
        return st.sampled_from(REQUEST_IDS) if "id" in f.name else st.text(max_size=12)
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if t == F.TYPE_ENUM:
        return st.integers(0, 6)
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return st.one_of(st.integers(0, 600), st.integers(0, 2**32 - 1))
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return st.integers(-(2**63), 2**63 - 1)
    return st.one_of(st.integers(-5, 600), st.integers(-(2**31), 2**31 - 1))


@st.composite
def message(draw, desc, depth=0):
    msg_cls = _classes[desc.full_name]
    m = msg_cls()
    for f in desc.fields:
        if not draw(st.booleans()):
            continue
        if f.type == F.TYPE_MESSAGE:
            if depth >= 2:
                continue
            values = draw(st.lists(message(f.message_type, depth + 1), max_size=3)) \
                if _repeated(f) else [draw(message(f.message_type, depth + 1))]
            for v in values:
                (getattr(m, f.name).add().CopyFrom(v) if _repeated(f) else getattr(m, f.name).CopyFrom(v))
        elif _repeated(f):
            getattr(m, f.name).extend(draw(st.lists(_scalar(f), max_size=40)))
        else:
            setattr(m, f.name, draw(_scalar(f)))
    return m


_classes = {}
for _name in dir(cluster_pb2):
    _c = getattr(cluster_pb2, _name)
    if hasattr(_c, "DESCRIPTOR") and hasattr(_c.DESCRIPTOR, "full_name"):
        _classes[_c.DESCRIPTOR.full_name] = _c
from serving.pb import common_pb2  # noqa: E402

for _name in dir(common_pb2):
    _c = getattr(common_pb2, _name)
    if hasattr(_c, "DESCRIPTOR") and hasattr(_c.DESCRIPTOR, "fields"):
        _classes[_c.DESCRIPTOR.full_name] = _c


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(STACK, str(tmp_path_factory.mktemp("fuzz")), use_link=False)
    yield s
    s.close()


def call(ch, service, method, payload, raw: bool):
    path = f"/{service.full_name}/{method.name}"
    ser = (lambda b: b) if raw else (lambda m: m.SerializeToString())
    out_cls = _classes[method.output_type.full_name]
    kw = dict(request_serializer=ser, response_deserializer=out_cls.FromString)
    if method.client_streaming:
        fn = ch.stream_stream(path, **kw) if method.server_streaming else ch.stream_unary(path, **kw)
        payload = iter(payload)
    else:
        fn = ch.unary_stream(path, **kw) if method.server_streaming else ch.unary_unary(path, **kw)
    try:
        r = fn(payload, timeout=3)
        if method.server_streaming:
            list(r)
    except grpc.RpcError as e:
        assert e.code() in DELIBERATE, (method.name, e.code(), e.details())


def _inputs(method):
    desc = method.input_type
    one = message(desc)
    if method.client_streaming:
        return st.tuples(st.lists(one, max_size=3), st.just(False)) | \
            st.tuples(st.lists(st.binary(max_size=80), max_size=3), st.just(True))
    return st.tuples(one, st.just(False)) | st.tuples(st.binary(max_size=80), st.just(True))


CASES = [(role, m.name) for role, svc in SERVICES.items() for m in svc.methods]


@pytest.mark.parametrize("role,method_name", CASES)
def test_fuzz_rpc(stack, role, method_name):
    svc = SERVICES[role]
    method = svc.methods_by_name[method_name]
    ch = grpc.insecure_channel(stack.addr[role])

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=_inputs(method))
    def fuzz(data):
        payload, raw = data
        call(ch, svc, method, payload, raw)

    try:
        fuzz()
    finally:
        ch.close()


def test_services_still_serve_and_hold_nothing(stack):
    for role, stub_cls in (("prefill", cluster_pb2_grpc.PrefillStub), ("main", cluster_pb2_grpc.DecodeStub)):
        with grpc.insecure_channel(stack.addr[role]) as ch:
            stub = stub_cls(ch)
            for rid in REQUEST_IDS:
                try:
                    stub.Release(cluster_pb2.ReleaseRequest(request_id=rid, cancel=True), timeout=10)
                except grpc.RpcError as e:
                    assert e.code() in DELIBERATE
            info = stub.Info(cluster_pb2.InfoRequest(), timeout=10)
            assert not info.integrity_error, info.integrity_error
            assert info.pages_active == 0 and info.requests == 0, (role, info)
