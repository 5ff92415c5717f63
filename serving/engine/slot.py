"""A request's state on a Decode service (RLD or MD), shared by decode_service, decode_kv and
decode_handoff: the Slot, the failure a stream or a waiting RPC ends with, and `resolve`."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc


@dataclasses.dataclass
class Slot:
    request_id: str
    out: asyncio.Queue  # TokenBatch | RpcFailure, read by the Decode stream
    emit_from: int | None = None  # output positions >= this go to the user (engine thread)
    waiters: list = dataclasses.field(default_factory=list)  # (kv tokens needed, asyncio.Future)
    closed: bool = False
    decoding: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # KV landed, tokens flow
    touched: float = dataclasses.field(default_factory=time.monotonic)  # last RPC about it (lease)
    streams: int = 0  # open Decode streams (a stream keeps the lease)
    born: float = dataclasses.field(default_factory=time.monotonic)
    reported: bool = False  # logged once when it outlives LINGER_LEASES leases (diagnostics)


@dataclasses.dataclass
class RpcFailure:
    """How a Decode stream (or a HandoffTokens waiting on its ack) ends: aborted with this status."""
    code: grpc.StatusCode
    message: str


def resolve(fut: asyncio.Future, value) -> None:
    """Event-loop thread: set a future's result unless it is already done."""
    if not fut.done():
        fut.set_result(value)
