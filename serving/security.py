"""TLS between services and bearer-token auth on the router's public port.

Process-wide, from the environment (so `pddjax up` hands it to every child it starts):
- PDDJAX_TLS_DIR: a directory with ca.pem, cert.pem, key.pem. Internal services then listen
  with mutual TLS (a client must present a certificate signed by the CA) and dial each other
  with that certificate; the router's public port uses server-side TLS (clients verify it with
  the CA and need no certificate of their own).
- PDDJAX_ROUTER_TOKEN_FILE: a file holding the token the router requires as
  `authorization: Bearer <token>` metadata (missing or wrong -> UNAUTHENTICATED; health checks
  stay open). Clients read the same variable.
Nothing on the wire is pickled: every message is protobuf.
"""

from __future__ import annotations

import functools
import hmac
import os

import grpc

TLS_DIR_ENV = "PDDJAX_TLS_DIR"
TOKEN_FILE_ENV = "PDDJAX_ROUTER_TOKEN_FILE"


class SecurityConfigError(ValueError):
    """Unreadable TLS material or token (one sentence)."""


@functools.cache
def tls_material(tls_dir: str | None = None) -> tuple[bytes, bytes, bytes] | None:
    """(ca, cert, key) PEM bytes, or None when TLS is off."""
    d = tls_dir or os.environ.get(TLS_DIR_ENV)
    if not d:
        return None
    try:
        return tuple(open(os.path.join(d, n), "rb").read() for n in ("ca.pem", "cert.pem", "key.pem"))
    except OSError as e:
        raise SecurityConfigError(f"cannot read TLS material in {d}: {e.strerror} ({e.filename})") from None


@functools.cache
def router_token(path: str | None = None) -> str | None:
    p = path or os.environ.get(TOKEN_FILE_ENV)
    if not p:
        return None
    try:
        token = open(p).read().strip()
    except OSError as e:
        raise SecurityConfigError(f"cannot read the router token file {p}: {e.strerror}") from None
    if not token:
        raise SecurityConfigError(f"the router token file {p} is empty")
    return token


def channel_credentials() -> grpc.ChannelCredentials | None:
    m = tls_material()
    if m is None:
        return None
    ca, cert, key = m
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def server_credentials(public: bool) -> grpc.ServerCredentials | None:
    """Mutual TLS for internal services; server-side TLS for the public (router) port."""
    m = tls_material()
    if m is None:
        return None
    ca, cert, key = m
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=not public)


def auth_metadata() -> list[tuple[str, str]]:
    token = router_token()
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
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._expected):
            return handler
        return _deny(handler, "missing or wrong bearer token" if got else "this router requires a bearer token")


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
