"""TLS identities, the rules for listening, and the router's bearer token.

Process-wide, from the environment (so `pddjax up` hands it to every child it starts):
- PDDJAX_TLS_DIR: a directory with ca.pem and, per role, <role>.pem + <role>-key.pem (prefill,
  relay, main, router; `pddjax certs DIR` makes a development set, serving/certs.py). Each
  role's certificate names the role as its SPIFFE ID (URI SAN spiffe://pddjax/role/<role>).
  A service listens and dials its peers with its own role's identity (`set_identity`, done by
  `serve`): internal ports require a client certificate of the CA (mutual TLS) and authorise
  each RPC by the caller's role (serving/authz.py); the router's public port is server-side
  TLS with the router's identity and asks clients for no certificate.
- PDDJAX_TLS_CA: the CA file a public client verifies the router with (else PDDJAX_TLS_DIR's
  ca.pem). A client (serving/client.py) loads only this: internal keys never leave the cluster.
- PDDJAX_ROUTER_TOKEN_FILE: a file holding the token the router requires as
  `authorization: Bearer <token>` metadata (missing or wrong -> UNAUTHENTICATED; health checks
  stay open). Clients read the same variable.
Plaintext: a service refuses to listen in plaintext on a non-loopback address unless told
`insecure` (`listen_problem`), the router never takes a token in plaintext there, and a client
never sends one in plaintext to a non-loopback address. Without TLS there are no identities,
so no per-role authorisation either: plaintext is for loopback development.
Nothing on the wire is pickled: every message is protobuf.
"""

from __future__ import annotations

import functools
import hmac
import os

import grpc

from pddjax import env
from pddjax.addresses import is_loopback
from pddjax.errors import UserError

TLS_DIR_ENV = env.TLS_DIR.name
CA_FILE_ENV = env.TLS_CA.name
TOKEN_FILE_ENV = env.ROUTER_TOKEN_FILE.name
ROLES = ("prefill", "relay", "main", "router")
SPIFFE_PREFIX = "spiffe://pddjax/role/"

_identity: str | None = None  # this process's role: the certificate it dials its peers with


class SecurityConfigError(UserError):
    """Unreadable TLS material or token, or an unsafe setting (one sentence)."""


def cert_file(role: str) -> str:
    return f"{role}.pem"


def key_file(role: str) -> str:
    return f"{role}-key.pem"


def set_identity(role: str | None) -> None:
    """The role whose certificate this process presents when it dials a peer."""
    global _identity
    _identity = role


def tls_dir() -> str | None:
    return env.TLS_DIR.get()


@functools.cache
def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise SecurityConfigError(f"cannot read {what} {path}: {e.strerror}") from None


@functools.cache
def role_material(role: str, directory: str | None = None) -> tuple[bytes, bytes, bytes] | None:
    """(ca, cert, key) PEM bytes of `role` from the TLS directory, or None when TLS is off."""
    d = directory or tls_dir()
    if d is None:
        return None
    if role not in ROLES:
        raise SecurityConfigError(f"unknown role {role!r} for a TLS identity: use one of {', '.join(ROLES)}")
    cert = os.path.join(d, cert_file(role))
    if not os.path.exists(cert) and os.path.exists(os.path.join(d, "cert.pem")):
        raise SecurityConfigError(f"{d} holds one shared cert.pem; every role needs its own certificate now "
                                  f"({cert_file(role)}, {key_file(role)}): make a set with `pddjax certs DIR`")
    return (_read(os.path.join(d, "ca.pem"), "the CA certificate"), _read(cert, f"the {role} certificate"),
            _read(os.path.join(d, key_file(role)), f"the {role} key"))


def channel_credentials(role: str | None = None) -> grpc.ChannelCredentials | None:
    """Mutual TLS to a peer service with `role`'s identity (default: this process's); a process
    with no identity (a gateway, a tool) dials as a public client: the CA only. None: plaintext."""
    role = role or _identity
    if role is None:
        return client_credentials()
    if tls_dir() is None:
        return None
    ca, cert, key = role_material(role)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def server_credentials(role: str) -> grpc.ServerCredentials | None:
    """`role`'s identity; mutual TLS on internal ports, server-side TLS on the router's public port."""
    m = role_material(role)
    if m is None:
        return None
    ca, cert, key = m
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=role != "router")


def client_credentials(ca: bytes | str | None = None) -> grpc.ChannelCredentials | None:
    """A public client's TLS: the CA only (PEM bytes or a path; else PDDJAX_TLS_CA, else
    PDDJAX_TLS_DIR/ca.pem), never a certificate or key. None when none is given (plaintext)."""
    if ca is None:
        path = env.TLS_CA.get() or (os.path.join(tls_dir(), "ca.pem") if tls_dir() else None)
        if path is None:
            return None
        ca = path
    pem = ca if isinstance(ca, bytes) else _read(ca, "the CA certificate")
    return grpc.ssl_channel_credentials(root_certificates=pem)


def listen_problem(role: str, host: str, tls: bool, insecure: bool, token: bool) -> str | None:
    """One sentence on why `role` must not listen on `host` this way, or None."""
    if tls or is_loopback(host):
        return None
    where = host or "every interface"
    if role == "router" and token:
        return (f"the router will not take a bearer token in plaintext on {where}: give it TLS "
                f"(--tls-dir or {TLS_DIR_ENV}) or listen on a loopback address")
    if not insecure:
        return (f"refusing to serve {role} in plaintext on the non-loopback address {where}: give a TLS "
                f"directory (--tls-dir or {TLS_DIR_ENV}) or pass --insecure (config: insecure = true)")
    return None


@functools.cache
def router_token(path: str | None = None) -> str | None:
    p = path or env.ROUTER_TOKEN_FILE.get()
    if not p:
        return None
    try:
        with open(p) as f:
            token = f.read().strip()
    except OSError as e:
        raise SecurityConfigError(f"cannot read the router token file {p}: {e.strerror}") from None
    if not token:
        raise SecurityConfigError(f"the router token file {p} is empty")
    return token


def clear_caches() -> None:
    """Forget what was read (after the environment changed: CLI flags, tests)."""
    for f in (_read, role_material, router_token):
        f.cache_clear()


def auth_metadata(token: str | None = None) -> list[tuple[str, str]]:
    token = token or router_token()
    return [("authorization", f"Bearer {token}")] if token else []


class BearerAuth(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every RPC but health checks."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1."):
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        refusal = bearer_refusal(got, self._expected)
        return handler if refusal is None else _deny(handler, refusal)


def bearer_refusal(got: str | bytes | None, expected: bytes) -> str | None:
    """None if `got` (the Authorization value) is `expected` (b"Bearer <token>"; constant-time
    compare), else the sentence a caller is refused with (UNAUTHENTICATED / 401)."""
    got = got or b""
    if hmac.compare_digest(got.encode() if isinstance(got, str) else got, expected):
        return None
    return "missing or wrong bearer token" if got else "this router requires a bearer token"


def _deny(handler, message: str):
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover  (makes this an async generator)

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)
