"""Multi-host instances (engines/multihost.py): two CPU processes on this machine joined by
jax.distributed (gloo), one paged engine over both processes' devices (tensor_parallel = their
total, the KV pool split across the processes), process 0 leading and process 1 replaying its
device calls: the leader's tokens equal the monolithic reference's (greedy and seeded, with a
KV export and import on the way), the follower stops when told, and a process whose peer dies
exits 3 with one sentence instead of hanging; `pddjax serve main` as the two processes serves
from process 0 only and decodes the reference's tokens; the settings' checks.

This file is also the subprocess script (`python -m tests.engines.test_multihost CASE COORD PID DEVICES`)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from pddjax.model.sampling_params import SamplingParams
from tests.support.paths import ROOT
from tests.support.samples import prompt

pytestmark = pytest.mark.timeout(300)
ENGINE = dict(page_size=16, num_pages=16, max_step_tokens=16, max_rows=2)  # 5 step shapes (each compiles per process)
NO_STOP = ()
LIMIT_S = 240  # every subprocess (a loaded machine compiles slowly)


PROMPTS = {"short": prompt(5, 1), "page": prompt(8, 2), "long": prompt(40, 3)}  # long: chunked prefill
SAMPLING = {"greedy": {}, "seeded": {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 11}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], devices: int, out, tls_dir=None) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "PDDJAX_HEARTBEAT_SECONDS": "10", **({"PDDJAX_TLS_DIR": str(tls_dir)} if tls_dir else {})}
    return subprocess.Popen([sys.executable, "-m", "tests.engines.test_multihost", *args],
                            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def run_pair(tmp_path, case: str, devices: int = 1, extra: str = "", tls_dir=None) -> tuple[list[int], list[str]]:
    """Both processes of one case -> (exit codes, outputs); each is killed past LIMIT_S. `tls_dir`:
    the op channel is mutual TLS with its `main` certificates."""
    coord = f"127.0.0.1:{free_port()}"
    logs = [open(tmp_path / f"{case}-{i}.log", "w+") for i in range(2)]
    procs = [spawn([case, coord, str(i), str(devices), extra], devices, logs[i], tls_dir) for i in range(2)]
    deadline = time.monotonic() + LIMIT_S
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            codes.append(-9)
    outs = []
    for f in logs:
        f.seek(0)
        outs.append(f.read())
        f.close()
    return codes, outs


def reference_engine(tiny):
    from pddjax.engines.reference import ReferenceEngine

    return ReferenceEngine(tiny.config, tiny.weights)


def reference_tokens(tiny) -> dict:
    ref = reference_engine(tiny)
    return {f"{s}/{name}": ref.generate(p, SamplingParams(**kw), 10, NO_STOP).token_ids
            for s, kw in SAMPLING.items() for name, p in PROMPTS.items()}


def test_multihost_settings_come_from_the_role_table_and_the_flags():
    import argparse

    from pddjax.errors import UserError
    from serving.cli.serve import _apply_multihost_flags
    from serving.config import service_config

    stack = {"main": {"coordinator_address": "10.0.0.1:8476", "num_processes": 2, "process_id": 0}}
    cfg = service_config(stack, "main")
    assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id) == ("10.0.0.1:8476", 2, 0)
    assert service_config({}, "relay").num_processes == 1
    flags = argparse.Namespace(coordinator="lead:9", num_processes=4, process_id=3)
    with pytest.raises(UserError, match="op channel in plaintext across hosts"):  # no TLS directory here
        _apply_multihost_flags(flags, cfg)
    cfg.insecure = True
    _apply_multihost_flags(flags, cfg)
    assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id) == ("lead:9", 4, 3)
    for bad, says in ((dict(process_id=2), "process_id must be in"), (dict(coordinator_address=None), "HOST:PORT"),
                      (dict(coordinator_address="nohost"), "HOST:PORT"), (dict(num_processes="x"), "an integer")):
        with pytest.raises(UserError, match=says):
            service_config({"main": {**stack["main"], **bad}}, "main")
    with pytest.raises(UserError, match="process_id must be in"):
        _apply_multihost_flags(argparse.Namespace(coordinator=None, num_processes=None, process_id=4), cfg)
    with pytest.raises(UserError, match="not the router"):
        _apply_multihost_flags(argparse.Namespace(coordinator="a:1", num_processes=None, process_id=None),
                               service_config({}, "router"))


@pytest.mark.parametrize("devices", [1], ids=["1+1 devices"])  # [2] (TP 4, KV replicated) passes too: 42 s here
def test_an_engine_over_two_processes_matches_the_reference(tiny, tmp_path, devices):
    expected = reference_tokens(tiny)
    codes, outs = run_pair(tmp_path, "engine", devices)
    assert codes == [0, 0], outs
    got = json.loads(outs[0].strip().splitlines()[-1])
    assert got["tokens"] == expected
    assert got["degree"] == 2 * devices and got["kv_split"] and got["ops_sent"] > 0
    assert "follower: stop" in outs[1], outs[1][-2000:]


@pytest.mark.parametrize("dies", [0, 1], ids=["leader dies", "follower dies"])
def test_a_process_whose_peer_dies_exits_with_one_sentence(tmp_path, dies):
    """Over mutual TLS (the engine cases run the loopback default: the key's challenge only)."""
    from serving.certs import make_dev_certs

    make_dev_certs(str(tmp_path / "tls"))
    t0 = time.monotonic()
    codes, outs = run_pair(tmp_path, "die", extra=str(dies), tls_dir=tmp_path / "tls")
    assert "1 follower(s) joined the op channel over mutual TLS" in outs[0], outs[0]
    survivor = 1 - dies
    assert codes[dies] == 1 and codes[survivor] == 3, (codes, outs)
    assert ("the leader is gone" if dies == 0 else "follower process 1 is gone") in outs[survivor], outs[survivor]
    assert time.monotonic() - t0 < 60  # the channel's end, not JAX's heartbeat timeout


def test_main_over_two_processes_serves_from_process_0_only(tiny, tmp_path, monkeypatch):
    """`pddjax serve main` as process 0 (config) and 1 (flags), tensor_parallel 2 over one device
    each, with a TLS directory: only process 0 listens; its op channel is mutual TLS (the service
    wiring hands `main`'s certificates to engines/multihost.py); a Reserve + Decode as the router
    and a PushKV as P (P's KV and first token) give the reference's tokens; SIGTERM on process 0
    drains it, stops its follower, and both exit 0.
    (2 devices each, tensor_parallel 4, KV replicated: passes too, 68 s here; not run, for time.)"""
    import asyncio

    import grpc
    import psutil

    from serving import kvwire, rpc, security
    from serving.certs import make_dev_certs
    from serving.pb import cluster_pb2, cluster_pb2_grpc
    from tests.support.inprocess import aiter, prefill_runs

    params = SamplingParams(**SAMPLING["seeded"])
    p = PROMPTS["long"]
    run = prefill_runs(tiny, {"r": p}, params)["r"]
    want = reference_engine(tiny).generate(p, params, 10, NO_STOP).token_ids
    coord = f"127.0.0.1:{free_port()}"
    stack = {"model": "tiny", "platform": "cpu",
             "main": {**ENGINE, "tensor_parallel": 2, "coordinator_address": coord, "num_processes": 2,
                      "process_id": 0}}
    cfg, ready = tmp_path / "stack.json", tmp_path / "main.ready.json"
    cfg.write_text(json.dumps(stack))
    serve = [sys.executable, "-m", "serving", "serve", "main", "--config", str(cfg)]
    logs = [open(tmp_path / f"serve-{i}.log", "w+") for i in range(2)]
    make_dev_certs(str(tmp_path / "tls"))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "PDDJAX_HEARTBEAT_SECONDS": "10",
           "PDDJAX_TLS_DIR": str(tmp_path / "tls")}
    procs = [subprocess.Popen(serve + ["--ready-file", str(ready)], stdout=logs[0], stderr=subprocess.STDOUT, env=env),
             subprocess.Popen(serve + ["--process-id", "1"], stdout=logs[1], stderr=subprocess.STDOUT, env=env)]

    def as_role(role: str, address: str):
        return grpc.aio.secure_channel(address, security.channel_credentials(role))

    async def decode(address: str) -> list[int]:
        async with as_role("router", address) as ch, as_role("prefill", address) as pch:
            stub = cluster_pb2_grpc.DecodeStub(ch)
            spec = cluster_pb2.SequenceSpec(request_id="r", prompt=p, sampling=rpc.sampling_to_pb(params),
                                            max_tokens=10)
            await stub.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=False), timeout=30)
            await cluster_pb2_grpc.DecodeStub(pch).PushKV(aiter(kvwire.chunks("r", run, 0, [want[0]], 4096)),
                                                          timeout=30)
            out = []
            async for batch in stub.Decode(cluster_pb2.DecodeRequest(request_id="r"), timeout=60):
                out += list(batch.token_ids)
            return out

    try:
        deadline = time.monotonic() + LIMIT_S
        while not ready.exists():
            assert time.monotonic() < deadline and all(q.poll() is None for q in procs), read(logs)
            time.sleep(0.5)
        address = json.loads(ready.read_text())["address"]
        monkeypatch.setenv(security.TLS_DIR_ENV, str(tmp_path / "tls"))
        security.clear_caches()
        listening = [{c.laddr.port for c in psutil.Process(q.pid).net_connections("tcp")
                      if c.status == psutil.CONN_LISTEN} for q in procs]
        got = asyncio.run(decode(address))
        procs[0].send_signal(signal.SIGTERM)
        codes = [q.wait(60) for q in procs]
    finally:
        for q in procs:
            q.kill()
        security.clear_caches()
    outs = read(logs)
    assert got == want
    assert "1 follower(s) joined the op channel over mutual TLS" in outs[0], outs[0][-2000:]
    assert codes == [0, 0], outs
    assert int(address.rsplit(":", 1)[1]) in listening[0] and int(address.rsplit(":", 1)[1]) not in listening[1]
    assert "loading on" not in outs[1] and "serving on" not in outs[1]  # (its listening sockets are gloo's)
    assert "following the leader" in outs[1] and "the leader stopped" in outs[1], outs[1][-2000:]


def read(logs) -> list[str]:
    out = []
    for f in logs:
        f.flush()
        f.seek(0)
        out.append(f.read())
    return out


# ---- the subprocess side ----------------------------------------------------------------

def _join(coord: str, pid: int):
    from pddjax.model.jax_setup import configure

    configure("cpu")
    from pddjax import env
    from pddjax.engines import multihost
    from serving.stack.server import op_channel_tls

    tls = op_channel_tls("main") if env.TLS_DIR.get() else None  # (the service's own wiring)
    multihost.initialize(coord, 2, pid)
    return multihost.Leader.open(coord, 2, tls=tls) if pid == 0 else multihost.Follower.connect(coord, pid, tls=tls)


def _engine(leader, degree: int):
    from pddjax.engines.multihost import LeaderEngine
    from pddjax.engines.paged_engine import EngineConfig, PagedEngine
    from pddjax.model.registry import load_model

    model = load_model("tiny")
    config = EngineConfig(**ENGINE, tensor_parallel=degree)
    if leader is not None:
        return LeaderEngine(model.config, model.weights, model.fingerprint, config, leader=leader)
    return PagedEngine(model.config, model.weights, model.fingerprint, config)


def _lead(engine) -> dict:
    """As the services drive an engine: batches to the end, and a P -> MD style KV move."""
    tokens = {}
    for s, kw in SAMPLING.items():
        params = SamplingParams(**kw)
        for name, p in PROMPTS.items():
            if name == "long":
                continue  # below, through a KV export and import
            engine.add(f"{s}/{name}", p, params, 10, NO_STOP)
        while engine.has_work():
            for ev in engine.step():
                tokens.setdefault(ev.seq_id, []).append(ev.token)
        rid = f"{s}/long"
        engine.add("p", PROMPTS["long"], params, 1, NO_STOP, hold_on_finish=True)
        while not engine.seqs["p"].generated:
            engine.step()
        first, kv = engine.seqs["p"].generated[0], engine.export_kv("p")
        engine.release("p", cache=False)
        engine.add(rid, PROMPTS["long"], params, 10, NO_STOP, use_cache=False)
        engine.import_kv(rid, kv)
        engine.append_tokens(rid, 0, [first])
        tokens[rid] = [first]
        while engine.has_work():
            tokens[rid] += [ev.token for ev in engine.step()]
        engine.check_integrity()
    return tokens


def main(case: str, coord: str, pid: int, devices: int, extra: str) -> int:
    from pddjax.engines import multihost

    channel = _join(coord, pid)
    if case == "die":
        if pid == int(extra):
            os._exit(1)
        if pid == 1 and multihost.follow(None, channel) == "lost":
            os._exit(multihost.EXIT_LOST)  # (no jax.distributed shutdown: its coordinator is gone)
        time.sleep(30)  # the leader's watcher ends it before this
        return 0
    import jax

    engine = _engine(channel if pid == 0 else None, 2 * devices)
    if pid == 0:
        tokens = _lead(engine)
        channel.close()
        multihost.shutdown()
        print(json.dumps({"tokens": tokens, "degree": engine.layout.degree, "kv_split": engine.layout.kv_sharded,
                          "ops_sent": channel.ops_sent, "devices": len(jax.devices())}), flush=True)
        return 0
    result = multihost.follow(engine, channel)
    print(f"follower: {result}", flush=True)
    if result != "stop":
        os._exit(multihost.EXIT_LOST)
    multihost.shutdown()
    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(main(a[0], a[1], int(a[2]), int(a[3]), a[4] if len(a) > 4 else ""))
