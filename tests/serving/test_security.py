"""Security (issue 8 point 6; issue 17 defects 5 and 6): no plaintext on a non-loopback address
unless asked, per-role certificates (serving/certs.py), reflection only when asked, public
clients that hold the CA and the bearer token only, and no token in plaintext.

One real stack, `pddjax up --tls --auth-token-file` (development certificates made by up): a
client with nothing but a copy of ca.pem and the token gets exact tokens through a pdd request
that hands off (router -> P, P -> RLD and -> MD through the WAN link, RLD -> MD, each with its
own identity); internal ports refuse a caller without a client certificate."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import grpc
import numpy as np
import pytest
from cryptography import x509
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pddjax.engines.reference import ReferenceEngine
from pddjax.model.sampling_params import SamplingParams
from serving import security
from serving.certs import make_dev_certs
from serving.client import Client, RouterError, make_request
from serving.config import ServiceConfig
from serving.pb import cluster_pb2, cluster_pb2_grpc
from serving.stack.server import listen
from tests.support.paths import ROOT
from tests.support.serving_stack import launch_up

pytestmark = pytest.mark.timeout(400)
STACK = {"model": "tiny", "platform": "cpu",
         "engine": {"dtype": "float32", "page_size": 16, "num_pages": 128, "max_step_tokens": 64, "max_rows": 4},
         "router": {"chunk_bytes": 4096, "handoff_threshold": 48}}
TOKEN = "s3cret-token"


# ---- the listen rules, the client's refusal, reflection, certificates (no stack) ---------
@pytest.mark.parametrize("role,host,tls,insecure,token,refused", [
    ("main", "127.0.0.1", False, False, False, None),
    ("main", "localhost", False, False, False, None),
    ("main", "::1", False, False, False, None),
    ("main", "0.0.0.0", False, False, False, "refusing to serve main in plaintext"),
    ("prefill", "10.0.0.5", False, False, False, "refusing to serve prefill in plaintext"),
    ("prefill", "10.0.0.5", False, True, False, None),  # --insecure
    ("main", "0.0.0.0", True, False, False, None),
    ("router", "0.0.0.0", False, True, True, "will not take a bearer token in plaintext"),  # not even --insecure
    ("router", "0.0.0.0", True, False, True, None),
    ("router", "127.0.0.1", False, False, True, None),
])
def test_listen_rules(role, host, tls, insecure, token, refused):
    problem = security.listen_problem(role, host, tls, insecure, token)
    assert (problem is None) if refused is None else (refused in problem and problem.count(". ") == 0)


def _serve(tmp_path, role: str, stack: dict, *flags) -> subprocess.CompletedProcess:
    cfg = tmp_path / "stack.json"
    cfg.write_text(json.dumps(stack))
    env = {k: v for k, v in os.environ.items() if k not in (security.TLS_DIR_ENV, security.TOKEN_FILE_ENV)}
    return subprocess.run([sys.executable, "-m", "serving", "serve", role, "--config", str(cfg), *flags],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def test_cli_refuses_plaintext_on_a_non_loopback_address(tmp_path):
    r = _serve(tmp_path, "main", {"model": "tiny", "platform": "cpu", "host": "0.0.0.0"})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "pddjax: error: refusing to serve main in plaintext on the non-loopback address 0.0.0.0: give a TLS "
        "directory (--tls-dir or PDDJAX_TLS_DIR) or pass --insecure (config: insecure = true)"]
    (tmp_path / "token").write_text(TOKEN)
    r = _serve(tmp_path, "router", {"model": "tiny", "host": "0.0.0.0"}, "--insecure",
               "--auth-token-file", str(tmp_path / "token"))
    assert r.returncode == 2 and "will not take a bearer token in plaintext on 0.0.0.0" in r.stderr


def test_client_never_sends_a_token_in_plaintext_off_loopback(monkeypatch):
    for var in (security.TLS_DIR_ENV, security.CA_FILE_ENV, security.TOKEN_FILE_ENV):
        monkeypatch.delenv(var, raising=False)
    security.clear_caches()
    with pytest.raises(security.SecurityConfigError, match="refusing to send the bearer token in plaintext to "
                                                           "10.1.2.3:50051"):
        Client("10.1.2.3:50051", token=TOKEN)
    for ok in (Client("127.0.0.1:9", token=TOKEN), Client("10.1.2.3:50051")):  # loopback, or no token
        ok.close()


def test_reflection_only_when_asked():
    def services(reflection: bool):
        async def main():
            lst = await listen(ServiceConfig("main", reflection=reflection))  # loading: no model needed
            try:
                async with grpc.aio.insecure_channel(lst.address) as ch:
                    stub = reflection_pb2_grpc.ServerReflectionStub(ch)
                    req = reflection_pb2.ServerReflectionRequest(list_services="")
                    try:
                        async for resp in stub.ServerReflectionInfo(_one(req), timeout=10):
                            return sorted(s.name for s in resp.list_services_response.service)
                    except grpc.aio.AioRpcError as e:
                        return e.code()
            finally:
                await lst.server.stop(0)
        return asyncio.run(main())

    assert services(False) == grpc.StatusCode.UNIMPLEMENTED
    assert "pddjax.v1.Decode" in services(True)


async def _one(x):
    yield x


def test_dev_certificates_name_their_role(tmp_path):
    files = make_dev_certs(str(tmp_path), hosts=("localhost", "127.0.0.1", "10.0.0.7"))
    assert len(files) == 9
    for role in security.ROLES:
        cert = x509.load_pem_x509_certificate((tmp_path / security.cert_file(role)).read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [f"spiffe://pddjax/role/{role}"]
        assert "10.0.0.7" in [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
        assert os.stat(tmp_path / security.key_file(role)).st_mode & 0o077 == 0  # keys: owner only
    with pytest.raises(FileExistsError):
        make_dev_certs(str(tmp_path))


def test_the_old_shared_certificate_is_refused_with_a_sentence(tmp_path, monkeypatch):
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (tmp_path / name).write_text("x")
    monkeypatch.setenv(security.TLS_DIR_ENV, str(tmp_path))
    security.clear_caches()
    try:
        with pytest.raises(security.SecurityConfigError, match="pddjax certs DIR"):
            security.role_material("main")
    finally:
        security.clear_caches()


# ---- one real stack: pddjax up --tls --auth-token-file -----------------------------------
@pytest.fixture(scope="module")
def secure_up(tmp_path_factory):
    d = tmp_path_factory.mktemp("up")
    (d / "token").write_text(TOKEN + "\n")
    up = launch_up(d, STACK, "--tls", "--auth-token-file", str(d / "token"), "--wan-mbps", "2")
    try:
        client_dir = d / "client"  # what a user is given: the CA, nothing else
        client_dir.mkdir()
        shutil.copy(os.path.join(up.state["tls_dir"], "ca.pem"), client_dir / "ca.pem")
        yield up, str(client_dir / "ca.pem")
    finally:
        tls_dir = (up.state or {}).get("tls_dir")
        assert up.close() == 0
    assert tls_dir and not os.path.exists(tls_dir), f"the development keys outlived the stack in {tls_dir}"


@pytest.fixture
def no_tls_env(monkeypatch):
    for var in (security.TLS_DIR_ENV, security.CA_FILE_ENV, security.TOKEN_FILE_ENV):
        monkeypatch.delenv(var, raising=False)
    security.clear_caches()
    yield
    security.clear_caches()


def test_public_client_with_ca_and_token_only_gets_exact_tokens_through_a_handoff(secure_up, no_tls_env, tiny):
    """40 prompt tokens (20 KB of KV, ~0.1 s) to MD over the 2 Mb/s link: RLD decodes meanwhile
    and hands MD the tokens (RLD's identity calls HandoffTokens); fresh prompts until MD takes
    the stream over. (120 tokens took 0.27 s on the link, longer than RLD's 300 tokens once the
    numpy step made RLD ~1 ms per token: RLD finished first on every try. And MD takes over only
    once it holds every token the user has: with handoff chunks sent, RLD can still finish first,
    seen at 300 tokens; 450 leave MD more time.)"""
    up, ca = secure_up
    ref = ReferenceEngine(tiny.config, tiny.weights)
    c = Client(up.state["router"], token=TOKEN, ca=ca)
    try:
        for attempt in range(6):
            p = np.random.default_rng(90 + attempt).integers(3, 512, 40).tolist()
            r = c.generate(make_request(p, max_tokens=450, pipeline="pdd", handoff="chunked", ignore_eos=True),
                           timeout=240)
            assert r.token_ids == ref.generate(p, SamplingParams(), 450, ()).token_ids
            if r.usage["main_tokens"]:
                break
    finally:
        c.close()
    print(attempt, r.usage, r.timings)
    assert r.sources[0] == "relay" and r.sources[-1] == "main", r.usage


@pytest.mark.parametrize("token", [None, "wrong"])
def test_missing_or_wrong_token_is_unauthenticated(secure_up, no_tls_env, token):
    up, ca = secure_up
    c = Client(up.state["router"], token=token, ca=ca)
    try:
        with pytest.raises(RouterError) as e:
            c.generate(make_request([5, 6, 7], max_tokens=2), timeout=30)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        c.close()


def test_internal_ports_need_a_role_certificate_and_serve_no_reflection(secure_up, monkeypatch):
    up, ca_path = secure_up
    ca = open(ca_path, "rb").read()
    addr = next(s["address"] for s in up.state["services"] if s["role"] == "main")
    with grpc.insecure_channel(addr) as ch:  # plaintext: refused
        with pytest.raises(grpc.RpcError):
            cluster_pb2_grpc.DecodeStub(ch).Info(cluster_pb2.InfoRequest(), timeout=5)
    with grpc.secure_channel(addr, grpc.ssl_channel_credentials(root_certificates=ca)) as ch:  # a public client's TLS
        with pytest.raises(grpc.RpcError) as e:
            cluster_pb2_grpc.DecodeStub(ch).Info(cluster_pb2.InfoRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    monkeypatch.setenv(security.TLS_DIR_ENV, up.state["tls_dir"])
    security.clear_caches()
    try:
        for who, want in (("router", None), ("relay", grpc.StatusCode.PERMISSION_DENIED)):
            with grpc.secure_channel(addr, security.channel_credentials(who)) as ch:
                if want is None:
                    assert cluster_pb2_grpc.DecodeStub(ch).Info(cluster_pb2.InfoRequest(), timeout=10).num_pages > 0
                else:
                    with pytest.raises(grpc.RpcError) as e:
                        cluster_pb2_grpc.DecodeStub(ch).Info(cluster_pb2.InfoRequest(), timeout=10)
                    assert e.value.code() == want
        for target in (addr, up.state["router"]):  # reflection is off on internal and public ports
            with grpc.secure_channel(target, security.channel_credentials("router")) as ch:
                stub = reflection_pb2_grpc.ServerReflectionStub(ch)
                req = reflection_pb2.ServerReflectionRequest(list_services="")
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.ServerReflectionInfo(iter([req]), timeout=10, metadata=security.auth_metadata(TOKEN)))
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        security.clear_caches()
