"""P's push of one request to one target (serving/engine/kv_push.py) into a real RLD over gRPC
(the DecodeService on a grpc.aio server, tiny model), both ways P can send it: over the shared
PushKVStream (PDDJAX_KV_PUSH_STREAM=1, the default) and as one PushKV call per push (=0). Each
way, two requests pushed at once (exports arriving in pieces, as P's chunked prefill makes them)
land whole, their TransferDone reports the receiver's answer, and RLD decodes the monolithic
reference's tokens."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from pddjax.engines.reference import ReferenceEngine
from pddjax.kv.canonical import KVRun
from pddjax.model.sampling_params import SamplingParams
from serving import rpc
from serving.engine.decode import DecodeService
from serving.engine.kv_push import KVPusher
from serving.pb import cluster_pb2, cluster_pb2_grpc, common_pb2
from tests.support.inprocess import Ctx, engine, prefill_runs, slot_tokens

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams()
N = 10


def _halves(run: KVRun) -> list[KVRun]:
    """The run as two exports (P's chunked prefill): tokens [0, h) then [h, n)."""
    h = run.k.shape[1] // 2
    return [KVRun(run.fingerprint, run.start, run.k[:, :h], run.v[:, :h], run.dtype),
            KVRun(run.fingerprint, run.start + h, run.k[:, h:], run.v[:, h:], run.dtype)]


@pytest.mark.parametrize("stream", ["1", "0"])
def test_a_push_lands_whole_and_rld_decodes_the_reference(tiny, monkeypatch, stream):
    monkeypatch.setenv("PDDJAX_KV_PUSH_STREAM", stream)
    prompts = {f"r{i}": np.random.default_rng(i).integers(3, 512, 40 + 9 * i).tolist() for i in range(2)}
    ref = ReferenceEngine(tiny.config, tiny.weights)
    want = {rid: ref.generate(p, GREEDY, N, ()).token_ids for rid, p in prompts.items()}
    runs = prefill_runs(tiny, prompts, GREEDY)

    async def main():
        svc = DecodeService("relay", engine(tiny), tiny.config, {"role": rpc.ROLE_NAMES["relay"]})
        svc.start(asyncio.get_running_loop())
        server = grpc.aio.server()
        cluster_pb2_grpc.add_DecodeServicer_to_server(svc, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pusher = KVPusher(page_size=16, tensor_parallel=1)
        try:
            slots = {}
            for rid, p in prompts.items():
                spec = cluster_pb2.SequenceSpec(request_id=rid, prompt=p, sampling=rpc.sampling_to_pb(GREEDY),
                                                max_tokens=N)
                await svc.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=False), Ctx())
                slots[rid] = svc.slots.get(rid)
            target = cluster_pb2.KVTarget(address=f"127.0.0.1:{port}", role=common_pb2.ROLE_RELAY,
                                          include_first_token=True)
            queues = {rid: asyncio.Queue() for rid in prompts}
            pushes = [asyncio.create_task(pusher.push(rid, target, queues[rid], 0, len(p), 1024))
                      for rid, p in prompts.items()]
            for rid in prompts:
                first, last = _halves(runs[rid])
                queues[rid].put_nowait((first, None, None))
                await asyncio.sleep(0.05)
                queues[rid].put_nowait((last, want[rid][0], None))  # P's first token on the last export
            done = await asyncio.gather(*pushes)
            got = {rid: await slot_tokens(slot) for rid, slot in slots.items()}
            return done, got, len(pusher.links)
        finally:
            for ch in pusher.channels.values():
                await ch.close()
            await server.stop(0)
            svc.worker.stop()

    done, got, links = asyncio.run(main())
    assert got == want
    for d, p in zip(done, prompts.values()):
        assert (d.code, d.error, d.tokens) == (0, "", len(p)), d
        assert d.chunks >= 2 and d.bytes == d.native_bytes > 0 and 0 <= d.wire_ms <= d.ms
    assert links == (1 if stream == "1" else 0)
