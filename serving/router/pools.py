"""Instances per role for the router: selection (least-loaded, session affinity) and health.

A Pool holds one role's instances. `pick` answers the healthy instance to use: the preferred
one (the session's) when it is healthy and not excluded (MD: `sticky`), else the least loaded
(in-flight requests through this router), ties broken by preference and then by rotation.
An instance that fails its grpc.health.v1 check, or answers UNAVAILABLE, leaves the rotation;
it comes back once a check answers SERVING (`health_loop`'s `on_back`: the router re-probes an
MD's link then).
`Affinity` remembers, per session, the instance that holds its context (bounded, LRU).
Talking to an instance: `stub` (Prefill or Decode, by role), `info` (its ServiceInfo, asked
once), `kv_bytes_per_token` (from P's info: what one prompt token's KV weighs on the wire) and
`kv_stub` (a Decode stub over `kv_address`, the path peers' KV takes: the link probe's).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import re
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving import rpc
from serving.call_link import CallLink, CallStub
from serving.pb import cluster_pb2, cluster_pb2_grpc

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def channel(address: str) -> grpc.aio.Channel:
    return rpc.channel(address, rpc.PEER_CHANNEL_OPTIONS)  # TLS when configured (security.py)


SHORT = {"prefill": "P", "relay": "RLD", "main": "MD"}  # the roles in prose


def public_text(text: str, instances) -> str:
    """`text` with every internal address replaced (an instance's by its name, any other
    host:port by "an internal address"): what reaches users names no host or port."""
    for inst in instances:
        for a in {inst.address, inst.kv_address} - {""}:
            text = text.replace(a, inst.name)
    return _ADDRESS.sub("an internal address", text)


# host:port, ipv4:/ipv6: URIs and [v6]:port as gRPC and the OS write them in error details.
_ADDRESS = re.compile(r"(?:(?:ipv[46]|dns|unix):)?(?:\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]*[A-Za-z0-9]):\d{2,5}\b")


class NoInstance(Exception):
    pass


@dataclasses.dataclass(eq=False)
class Instance:
    role: str
    address: str
    kv_address: str = ""  # how peers reach it with KV and handoffs (MD: through the WAN link)
    healthy: bool = True
    slow_checks: int = 0  # health checks in a row that timed out (`judge`)
    inflight: int = 0  # requests through this router now
    info: object = None  # ServiceInfo, fetched once
    channel: object = None
    kv_channel: object = None  # to kv_address (the link probe), opened on first use
    name: str = ""  # what users see (explain, errors): "P0", "RLD1", "MD0"; never an address
    stub: object = None  # (channel, its Prefill / Decode stub), made once (a stub builds a callable per method)
    decode_stream: object = None  # RLD / MD: the DecodeStream every request's tokens come on (decode_streams.Mux)


class Pool:
    def __init__(self, role: str, addresses: list[str], kv_addresses: list[str] | None = None):
        kv = kv_addresses or addresses
        self.role = role
        self.instances = [Instance(role, a, k, name=f"{SHORT[role]}{n}") for n, (a, k) in enumerate(zip(addresses, kv))]
        self._turn = itertools.count()

    def healthy(self, exclude=()) -> list[Instance]:
        return [i for i in self.instances if i.healthy and i not in exclude]

    def get(self, address: str) -> Instance | None:
        return next((i for i in self.instances if i.address == address), None)

    def pick(self, prefer: str | None = None, sticky: bool = False, exclude=()) -> Instance:
        live = self.healthy(exclude)
        if not live:
            raise NoInstance(f"no healthy {self.role} instance ({len(self.instances)} configured)")
        pref = self.get(prefer) if prefer else None
        if sticky and pref in live:
            return pref
        turn, n = next(self._turn), len(self.instances)
        return min(live, key=lambda i: (i.inflight, i is not pref, (self.instances.index(i) - turn) % n))


class Affinity:
    """session id -> address of the instance that holds its context (LRU, bounded)."""

    def __init__(self, size: int = 100_000):
        self.map: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.size = size

    def get(self, sid: str) -> str | None:
        return self.map.get(sid) if sid else None

    def set(self, sid: str, address: str) -> None:
        if not sid:
            return
        self.map.pop(sid, None)
        self.map[sid] = address
        while len(self.map) > self.size:
            self.map.popitem(last=False)


def stub(inst: Instance):
    """The instance's Prefill stub, or its Decode stub whose Reserve, MatchPrefix, Release and
    HandoffTokens ride one Calls stream (serving/call_link.py); cached with its channel."""
    if inst.stub is None or inst.stub[0] is not inst.channel:
        if inst.role == "prefill":
            inst.stub = (inst.channel, cluster_pb2_grpc.PrefillStub(inst.channel))
        else:
            inst.stub = (inst.channel, CallStub(CallLink(inst.channel, f"{inst.role} {inst.address}")))
    return inst.stub[1]


def kv_stub(inst: Instance) -> cluster_pb2_grpc.DecodeStub:
    """A Decode stub over the path peers' KV takes to `inst` (MD: through the WAN link)."""
    if inst.kv_address == inst.address:
        if inst.channel is None:
            inst.channel = channel(inst.address)
        return cluster_pb2_grpc.DecodeStub(inst.channel)
    if inst.kv_channel is None:
        inst.kv_channel = channel(inst.kv_address)
    return cluster_pb2_grpc.DecodeStub(inst.kv_channel)


async def max_sequence_tokens(inst: Instance) -> int:
    """The most tokens one request can ever hold on `inst`: its whole KV pool but the scratch page
    (PagedEngine.max_sequence_tokens, from its ServiceInfo)."""
    i = await info(inst)
    return (i.num_pages - 1) * i.page_size


async def info(inst: Instance) -> cluster_pb2.ServiceInfo:
    if inst.info is None:
        inst.info = await stub(inst).Info(cluster_pb2.InfoRequest(), timeout=30)
    return inst.info


async def kv_bytes_per_token(inst: Instance) -> int:
    """K and V of every layer for one token, in the instance's dtype."""
    i = await info(inst)
    return 2 * i.num_layers * i.num_kv_heads * i.head_dim * _ITEMSIZE.get(i.dtype, 4)


SLOW_CHECKS = 3  # health checks in a row that time out before a live but busy instance leaves the rotation


async def check(inst: Instance, timeout: float) -> bool | None:
    """-> True (SERVING), False (it answered otherwise, or the call failed: gone, refused), None
    (no answer within `timeout`: alive but busy, or hung)."""
    if inst.channel is None:
        inst.channel = channel(inst.address)
    try:
        r = await health_pb2_grpc.HealthStub(inst.channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                timeout=timeout)
        return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.aio.AioRpcError as e:
        return None if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else False


def judge(inst: Instance, answer: bool | None) -> bool:
    """A check's answer -> the instance's health: an answer or a failed call counts at once; a
    timeout only once SLOW_CHECKS come in a row (a service compiling on a busy host can miss a
    2 s deadline now and then: on 2 cores three services did during `make demo` from an empty
    cache, and each miss took it out of the rotation for the request that came next)."""
    if answer is None:
        inst.slow_checks += 1
        return inst.healthy and inst.slow_checks < SLOW_CHECKS
    inst.slow_checks = 0
    return answer


def set_health(inst: Instance, ok: bool, counters: dict | None = None) -> bool:
    """-> whether the instance's health changed."""
    if ok != inst.healthy:
        inst.healthy = ok
        print(f"router: {inst.role} {inst.address} {'is back in' if ok else 'left'} the rotation",
              file=sys.stderr, flush=True)
        if counters is not None:
            key = "health_back" if ok else "health_left"
            counters[key] = counters.get(key, 0) + 1
        return True
    return False


async def health_loop(pools: list[Pool], interval: float, timeout: float, counters: dict | None = None,
                      on_back=None) -> None:
    """Checks every instance every `interval` seconds, forever (cancel to stop); `on_back(inst)`
    for each one that comes back into the rotation."""
    while True:
        insts = [i for p in pools for i in p.instances]
        answers = await asyncio.gather(*(check(i, timeout) for i in insts))
        for i, answer in zip(insts, answers):
            ok = judge(i, answer)
            if set_health(i, ok, counters) and ok and on_back is not None:
                on_back(i)
        await asyncio.sleep(interval)
