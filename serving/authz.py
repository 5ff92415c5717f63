"""Who may call what on the internal ports, and where P may send KV.

With TLS on, every caller of an internal port presents a certificate of the cluster's CA whose
SPIFFE ID names its role (spiffe://pddjax/role/<role>, serving/security.py); `RoleAuthz`
(a server interceptor on P, RLD and MD) lets an RPC through only if the caller's role is in
ALLOWED for that service, else PERMISSION_DENIED with a sentence. The table is what the code
calls today: the router drives every request (serving/router/*), P pushes KV
(engine/prefill.py), RLD hands token IDs to MD (engine/handoff.py), and the router sends MD the
final handoff itself when RLD is gone (router/recovery.py). Queries (Info, MatchPrefix, Probe)
are the router's on every service that has them; grpc.health.v1 and reflection (when it is
on) are open to every role. An RPC missing from the table is refused. Without TLS there are
no identities and nothing is checked (plaintext is for loopback development).

`KVPeers`: the addresses P may push KV to: `[prefill] kv_peers` (a list) and `kv_peers_file`
(a JSON list, re-read when it changes: `pddjax up` writes it once RLD and the WAN links in
front of MD listen, before the router starts). With neither, loopback addresses only.
"""

from __future__ import annotations

import inspect
import json
import os

import grpc

from pddjax.addresses import host_of, is_loopback
from serving import security

ROUTER, PREFILL, RELAY, MAIN = "router", "prefill", "relay", "main"
_R = frozenset({ROUTER})
_NONE: frozenset[str] = frozenset()

# method -> the roles that may call it, on (prefill, relay, main)
#                   on P      on RLD                on MD
_TABLE = {
    "Info":          (_R,     _R,                   _R),
    "MatchPrefix":   (_R,     _R,                   _R),
    "Prefill":       (_R,     _NONE,                _NONE),
    "Release":       (_R,     _R,                   _R),
    "Reserve":       (_NONE,  _R,                   _R),
    "PushKV":        (_NONE,  frozenset({PREFILL}), frozenset({PREFILL})),
    "PushKVStream":  (_NONE,  frozenset({PREFILL}), frozenset({PREFILL})),
    "Decode":        (_NONE,  _R,                   _R),
    "DecodeStream":  (_NONE,  _R,                   _R),
    "Calls":         (_NONE,  _R,                   frozenset({RELAY, ROUTER})),  # each call: its own row
    "Handoff":       (_NONE,  _R,                   _NONE),
    "Hold":          (_NONE,  _R,                   _NONE),
    "HandoffTokens": (_NONE,  _NONE,                frozenset({RELAY, ROUTER})),
    "Probe":         (_NONE,  _NONE,                _R),
}
ALLOWED: dict[str, dict[str, frozenset[str]]] = {  # service role -> method -> caller roles
    role: {m: callers[i] for m, callers in _TABLE.items() if callers[i]}
    for i, role in enumerate((PREFILL, RELAY, MAIN))}
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # any internal role


def peer_role(context) -> str | None:
    """The caller's role from its certificate's SPIFFE ID, or None."""
    for spiffe_id in (context.auth_context() or {}).get("peer_spiffe_id", ()):
        s = spiffe_id.decode(errors="replace")
        if s.startswith(security.SPIFFE_PREFIX) and s[len(security.SPIFFE_PREFIX):] in security.ROLES:
            return s[len(security.SPIFFE_PREFIX):]
    return None


def callers(role: str, method: str) -> frozenset[str]:
    """Who may call `method` ('/pkg.Service/Name') on a `role` service."""
    if method.startswith(OPEN_SERVICES):
        return frozenset(security.ROLES)
    return ALLOWED.get(role, {}).get(method.rsplit("/", 1)[-1], _NONE)


def refusal(role: str, method: str, caller: str | None) -> str | None:
    """One sentence on why `caller` may not call `method` on `role`, or None."""
    allowed = callers(role, method)
    if caller in allowed:
        return None
    name = method.rsplit("/", 1)[-1]
    who = f"the {caller} identity" if caller else "a certificate that names no pddjax role"
    if not allowed:
        return f"{name} is not served to anyone on {role}; {who} was refused"
    return f"{who} may not call {name} on {role} (only {' and '.join(sorted(allowed))} may)"


class RoleAuthz(grpc.aio.ServerInterceptor):
    """Lets an RPC on a `role` service through only for the callers ALLOWED lists."""

    def __init__(self, role: str):
        self.role = role

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        role, method = self.role, details.method

        async def check(context) -> None:
            why = refusal(role, method, peer_role(context))
            if why:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

        return _guarded(handler, check)


def _guarded(handler, check):
    """`handler` with `await check(context)` before its behaviour runs."""
    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.response_streaming:
        fn = handler.stream_stream if handler.request_streaming else handler.unary_stream
        if inspect.isasyncgenfunction(fn):
            async def behaviour(request, context):
                await check(context)
                responses = fn(request, context)
                try:
                    async for item in responses:
                        yield item
                finally:
                    await responses.aclose()  # the wrapped handler's cleanup runs now, never at a later GC
        else:  # a coroutine writing with context.write (grpc.health.v1 Watch)
            async def behaviour(request, context):
                await check(context)
                return await fn(request, context)
        make = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                else grpc.unary_stream_rpc_method_handler)
    else:
        fn = handler.stream_unary if handler.request_streaming else handler.unary_unary

        async def behaviour(request, context):
            await check(context)
            return await fn(request, context)
        make = (grpc.stream_unary_rpc_method_handler if handler.request_streaming
                else grpc.unary_unary_rpc_method_handler)
    return make(behaviour, **kw)


class KVPeers:
    """The addresses ('host:port', compared as written) P may push KV to."""

    def __init__(self, addresses=(), path: str | None = None):
        self.static, self.path = frozenset(addresses), path
        self._file: frozenset[str] = frozenset()
        self._stamp = None

    def _from_file(self) -> frozenset[str]:
        try:
            st = os.stat(self.path)
        except OSError:
            return frozenset()  # not written yet: nothing from it
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            try:
                with open(self.path) as f:
                    self._file = frozenset(str(a) for a in json.load(f))
            except (OSError, ValueError, TypeError):
                self._file = frozenset()
            self._stamp = stamp
        return self._file

    def allows(self, address: str) -> bool:
        if not self.static and self.path is None:
            return is_loopback(host_of(address))
        return address in self.static or (self.path is not None and address in self._from_file())

    def refusal(self, addresses) -> str | None:
        """One sentence on the first address P may not push KV to, or None."""
        for a in addresses:
            if not self.allows(a):
                where = ("[prefill] kv_peers / kv_peers_file" if self.static or self.path
                         else "loopback only, as no [prefill] kv_peers are configured")
                return f"{a or '(empty)'} is not a configured KV peer of this prefill service ({where})"
        return None
