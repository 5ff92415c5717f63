"""gRPC plumbing shared by every service: channel/server options (explicit message-size limits,
keepalive that long idle streams survive on both ends), TLS ports and channels (security.py),
channels to peers named by a request (`address_problem`, the bounded `PeerChannels`), health and
(opt-in) reflection, and the one place where protobuf messages become engine-side values
(`spec_from_pb`, `sampling_from_pb`)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pddjax.grammar.spec import GrammarSpec
from pddjax.model.sampling_params import SamplingParams
from serving.pb import cluster_pb2, common_pb2

MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # KV chunks are 1-4 MiB; 16 MiB leaves room for headers
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024

_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 20_000),  # ping an idle connection every 20 s
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    *_KEEPALIVE,
]
# Channels to peer services: reconnect soon after an instance comes back (gRPC's default
# backoff grows to 120 s).
PEER_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 200),
                        ("grpc.min_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),  # accept the clients' pings
    ("grpc.http2.max_ping_strikes", 0),
    *_KEEPALIVE,
]

ROLE_NAMES = {"prefill": common_pb2.ROLE_PREFILL, "relay": common_pb2.ROLE_RELAY, "main": common_pb2.ROLE_MAIN}


def channel(address: str, options=None) -> grpc.aio.Channel:
    """A channel to another service: mutual TLS with this process's role identity when
    PDDJAX_TLS_DIR is set; a process with no identity (a gateway) verifies with the CA only
    (security.channel_credentials)."""
    from serving import security

    creds, options = security.channel_credentials(), options or CHANNEL_OPTIONS
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, creds, options=options)


def sync_channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A blocking channel (public clients of the router): TLS with `credentials` (the CA only), else plaintext."""
    if credentials is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


_PEER_ADDRESS = re.compile(r"(?:dns:///)?(?:[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):([0-9]{1,5})")


def address_problem(address: str) -> str | None:
    """One sentence on why `address` is not a peer's HOST:PORT ('[v6]:port' and 'dns:///host:port'
    too), or None."""
    m = _PEER_ADDRESS.fullmatch(address)
    if m is None or not 0 < int(m.group(1)) < 65536:
        return f"{address[:80]!r} is not a HOST:PORT address"
    return None


class PeerChannels:
    """Channels to peers by address (`channel(address, options)`), at most `limit` kept: once a
    call ends, the least recently used channels with no call in flight are closed down to the
    limit (a channel in use is never closed under its calls). `use(address)` (an async context
    manager) lends the channel for the calls made inside it."""

    def __init__(self, limit: int, options=None):
        self.limit, self.options = limit, options
        self._open: collections.OrderedDict[str, grpc.aio.Channel] = collections.OrderedDict()  # oldest use first
        self._busy: collections.Counter[str] = collections.Counter()  # address -> calls in flight

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, address: str) -> bool:
        return address in self._open

    @contextlib.asynccontextmanager
    async def use(self, address: str):
        ch = self._open.pop(address, None) or channel(address, self.options)
        self._open[address] = ch  # the most recently used now
        self._busy[address] += 1
        try:
            yield ch
        finally:
            self._busy[address] -= 1
            if self._busy[address] <= 0:
                del self._busy[address]
            while len(self._open) > self.limit:  # looked up afresh after each close: others run meanwhile
                idle = next((a for a in self._open if a not in self._busy), None)
                if idle is None:
                    break
                await self._open.pop(idle).close()


def add_port(server, address: str, role: str) -> int:
    """Listen on `address` with `role`'s TLS identity when configured (mutual TLS on internal
    ports, server-side on the router's); returns the port."""
    from serving import security

    creds = security.server_credentials(role)
    return server.add_insecure_port(address) if creds is None else server.add_secure_port(address, creds)


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str],
                              reflection_on: bool = False) -> health.aio.HealthServicer:
    """Registers grpc.health.v1, and reflection only when asked (`reflection = true`). grpc's
    servicer reports the overall status "" as SERVING from the start: call
    `set_serving(hs, names, False)` until ready."""
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    if reflection_on:
        reflection.enable_server_reflection([*service_names, reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    return hs


async def set_serving(hs, service_names: list[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await hs.set(name, status)


def sampling_from_pb(s: common_pb2.Sampling) -> SamplingParams:
    """The wire's sampling as sent, except top_p = 0: proto3 cannot tell it from unset, so it reads
    as 1.0 (off). Any other out-of-range value (a negative or NaN top_p among them) passes through
    for `validate_spec` to refuse."""
    top_p = 1.0 if s.top_p == 0 else float(s.top_p)
    repetition = 1.0 if s.repetition_penalty == 0 else float(s.repetition_penalty)
    return SamplingParams(float(s.temperature), int(s.top_k), top_p, int(s.seed),
                          presence_penalty=float(s.presence_penalty), frequency_penalty=float(s.frequency_penalty),
                          repetition_penalty=repetition,
                          logit_bias=tuple((int(b.token_id), float(b.bias)) for b in s.logit_bias),
                          logprobs=bool(s.logprobs), top_logprobs=int(s.top_logprobs),
                          grammar=GrammarSpec(s.grammar.kind, s.grammar.text) if s.HasField("grammar") else None)


def sampling_to_pb(p: SamplingParams) -> common_pb2.Sampling:
    return common_pb2.Sampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
                               presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                               repetition_penalty=p.repetition_penalty,
                               logit_bias=[common_pb2.LogitBias(token_id=t, bias=b) for t, b in p.logit_bias],
                               logprobs=p.logprobs, top_logprobs=p.top_logprobs,
                               grammar=None if p.grammar is None else common_pb2.Grammar(kind=p.grammar.kind,
                                                                                          text=p.grammar.text))


def logprob_to_pb(lp) -> common_pb2.TokenLogprob:
    """An engine's TokenLogprobs (engines/engine_api.py) -> the wire's TokenLogprob."""
    return common_pb2.TokenLogprob(logprob=lp.logprob, top_ids=[t for t, _ in lp.top],
                                   top_logprobs=[v for _, v in lp.top])


def spec_from_pb(spec: cluster_pb2.SequenceSpec):
    """-> (request_id, prompt, SamplingParams, max_tokens, stop_ids); `no_speculation` becomes
    `SamplingParams.speculative` = False."""
    params = sampling_from_pb(spec.sampling)
    if spec.no_speculation:
        params = dataclasses.replace(params, speculative=False)
    return (spec.request_id, list(spec.prompt), params, int(spec.max_tokens), tuple(spec.stop_token_ids))


FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
          "cancelled": common_pb2.FINISH_REASON_CANCELLED, None: common_pb2.FINISH_REASON_UNSPECIFIED}


def validate_spec(cfg, rid, prompt, params, max_tokens) -> str | None:
    """One sentence on what is wrong with a request, or None."""
    if not rid:
        return "the request has no request_id"
    if not prompt:
        return "the prompt is empty"
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        return f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})"
    if max_tokens < 1:
        return f"max_tokens must be at least 1, got {max_tokens}"
    if len(prompt) + max_tokens > cfg.max_context:
        return (f"prompt ({len(prompt)} tokens) plus max_tokens {max_tokens} exceeds the model context of "
                f"{cfg.max_context}")
    try:
        params.validate(cfg.vocab_size)
    except ValueError as e:
        return str(e)
    return None


def time_left(context) -> float | None:
    """Seconds left before the caller's deadline (None: it brought none)."""
    return getattr(context, "time_remaining", lambda: None)()
