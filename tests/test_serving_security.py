"""Security (issue 8, point 6): mutual TLS between services, server-side TLS + bearer token on
the router's public port, reflection off there. Certificates come from `trustme` in the test."""

from __future__ import annotations

import grpc
import pytest
import trustme
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pddjax.engines.reference import ReferenceEngine
from pddjax.model.sampling_params import SamplingParams
from serving import security
from serving.client import Client, RouterError, make_request
from serving.pb import cluster_pb2, cluster_pb2_grpc
from tests.serving_stack import Stack

pytestmark = pytest.mark.timeout(400)
STACK = {"model": "tiny", "platform": "cpu",
         "engine": {"dtype": "float32", "page_size": 16, "num_pages": 64, "max_step_tokens": 64, "max_rows": 4}}


@pytest.fixture(scope="module")
def secure_stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    cert.private_key_pem.write_to_path(str(d / "key.pem"))
    (d / "token").write_text("s3cret-token\n")
    mp = pytest.MonkeyPatch()
    mp.setenv(security.TLS_DIR_ENV, str(d))
    mp.setenv(security.TOKEN_FILE_ENV, str(d / "token"))
    security.tls_material.cache_clear()
    security.router_token.cache_clear()
    stack = Stack(STACK, str(d))
    yield stack, d
    stack.close()
    mp.undo()
    security.tls_material.cache_clear()
    security.router_token.cache_clear()


def test_tls_and_token_serve_exact_tokens(secure_stack, tiny):
    stack, _ = secure_stack
    p = [5, 9, 300, 4, 77, 8, 100, 3]
    c = Client(stack.addr["router"])  # TLS + token from the environment
    try:
        r = c.generate(make_request(p, max_tokens=8, pipeline="pdd"), timeout=240)
    finally:
        c.close()
    want = ReferenceEngine(tiny.config, tiny.weights).generate(p, SamplingParams(), 8, (2,)).token_ids
    assert r.token_ids == want


@pytest.mark.parametrize("token", [None, "wrong"])
def test_missing_or_wrong_token_is_unauthenticated(secure_stack, monkeypatch, token):
    stack, _ = secure_stack
    monkeypatch.delenv(security.TOKEN_FILE_ENV)
    security.router_token.cache_clear()
    try:
        c = Client(stack.addr["router"], token=token)
        with pytest.raises(RouterError) as e:
            c.generate(make_request([5, 6, 7], max_tokens=2), timeout=30)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        c.close()
    finally:
        security.router_token.cache_clear()


def test_internal_services_need_a_client_certificate(secure_stack):
    stack, d = secure_stack
    ca = (d / "ca.pem").read_bytes()
    addr = stack.addr["main"]
    with grpc.insecure_channel(addr) as ch:  # plaintext: refused
        with pytest.raises(grpc.RpcError):
            cluster_pb2_grpc.DecodeStub(ch).Info(cluster_pb2.InfoRequest(), timeout=5)
    with grpc.secure_channel(addr, grpc.ssl_channel_credentials(root_certificates=ca)) as ch:  # no client cert
        with pytest.raises(grpc.RpcError):
            cluster_pb2_grpc.DecodeStub(ch).Info(cluster_pb2.InfoRequest(), timeout=5)
    with grpc.secure_channel(addr, security.channel_credentials()) as ch:  # mutual TLS: fine
        assert cluster_pb2_grpc.DecodeStub(ch).Info(cluster_pb2.InfoRequest(), timeout=10).num_pages > 0


def test_reflection_off_on_the_public_port(secure_stack):
    stack, _ = secure_stack
    with grpc.secure_channel(stack.addr["router"], security.channel_credentials()) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ServerReflectionInfo(iter([req]), timeout=10, metadata=security.auth_metadata()))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
