"""What the DecodeStream tests share (tests/serving/engine/test_decode_stream*.py): token batches,
a slot table, a DecodeStream service over real slots on a real gRPC server, and a bounded wait."""

from __future__ import annotations

import asyncio

import grpc

from serving.engine import decode_stream
from serving.pb import cluster_pb2, cluster_pb2_grpc
from serving.router import pools


def batch(start, tokens, finish=0, handed_off=False):
    return cluster_pb2.TokenBatch(start_position=start, token_ids=tokens, finish_reason=finish,
                                  handed_off=handed_off, handed_off_at=start + len(tokens) if handed_off else 0)


class Table(dict):
    """The SlotTable's `get` is all a Sink reads."""


class Engine(cluster_pb2_grpc.DecodeServicer):
    """DecodeStream over real slots (decode_stream.serve); the test feeds the slots."""

    def __init__(self, slots):
        self.table, self.sinks = Table(slots), []

    async def DecodeStream(self, request_iterator, context):
        sink = decode_stream.Sink(self.table, "relay")
        self.sinks.append(sink)
        async for msg in decode_stream.serve(sink, request_iterator):
            yield msg


async def start(servicer):
    """-> (the started server, an RLD Instance with a channel to it)."""
    server = grpc.aio.server()
    cluster_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    inst = pools.Instance("relay", f"127.0.0.1:{port}", name="RLD0")
    inst.channel = grpc.aio.insecure_channel(inst.address)
    return server, inst


async def until(cond, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")
