"""Multi-host instances: one engine over several processes (hosts), process 0 leading.

An instance of N processes (one per host: one pod each of a LeaderWorkerSet) runs one JAX
program over every process's devices. `initialize` starts `jax.distributed` (gloo collectives
on CPU) before any other JAX use, and the engine's mesh spans all devices (`tensor_parallel` =
their total, `engines/mesh.py`). JAX is multi-controller: every process must issue the same
device programs with the same inputs in the same order. Process 0, the leader, serves gRPC and
owns all host bookkeeping (sequences, pages, prefix cache); the others, followers, hold only the
weights and their shards of the KV pool, and replay the leader's device calls:

  leader: LeaderEngine (its Leader)             followers: follow(engine, channel)
  step()       batch + sampling arrays  --step-->   run_step (same arrays, same statics)
  import_kv()  KV pieces + pages        --import->  import_run (same)
  export_kv()  pages, start, end        --export->  the same gather (a collective across hosts)
  close()                               --stop-->   return; both call jax.distributed.shutdown

Both sides build and precompile their engine the same way (the same programs in the same order)
before the log starts. The log is a host channel: one TCP connection from each follower to the
leader, whose port (any free one; `PDDJAX_MULTIHOST_PORT` fixes it) and a 128-bit token reach
every process by one `broadcast_one_to_all` at start. An op is one frame
(engines/multihost_frames.py): a JSON header (op, statics, each array's dtype and shape), then
the raw bytes. Not `broadcast_one_to_all` per op: that is a device collective and a compiled
program per array shape, the follower needs the op and shapes before it can receive anything,
and an idle follower would wait inside a collective (gloo times out); the socket's end of file
also tells a follower that the leader died. A step sends a few KB; an import carries its whole
KV run (each follower keeps its shards).

Failures: the leader gone (its socket closes without a stop) -> `follow` returns "lost" after one
log line and the process exits 3; a follower gone -> the leader's watcher logs one line and exits
3 (no step can run without its devices; a LeaderWorkerSet then restarts the whole group). A host
that vanishes without closing its sockets is caught by JAX's coordination service, which aborts
every process of the instance after `PDDJAX_HEARTBEAT_SECONDS` (default 30) without heartbeats.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import secrets
import socket
import sys
import threading
import time

import jax
import numpy as np

from pddjax import env
from pddjax.engines.multihost_frames import LeaderGone, recv, send
from pddjax.engines.paged_engine import PagedEngine
from pddjax.engines.step import run_step
from pddjax.kv.canonical import KVImportError, KVRun, as_pieces, export_run, import_run
from pddjax.model.paged import PackedBatch

EXIT_LOST = 3  # a process whose peer died exits with this
CONNECT_SECONDS = 120.0  # jax.distributed start-up, and the channel's accept / connect
SHUTDOWN_SECONDS = 30  # jax.distributed's shutdown barrier


def heartbeat_seconds() -> int:
    return env.HEARTBEAT_SECONDS.get()


def initialize(coordinator: str | None, num_processes: int, process_id: int) -> bool:
    """Join the instance's `jax.distributed` group (before any JAX computation) -> True, or
    False for a single-process instance (nothing to do)."""
    if num_processes <= 1:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    jax.config.update("jax_enable_preemption_service", False)  # it would take SIGTERM from the service's drain
    jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=int(CONNECT_SECONDS),
                               heartbeat_timeout_seconds=heartbeat_seconds(), shutdown_timeout_seconds=SHUTDOWN_SECONDS)
    return True


def join(coordinator: str | None, num_processes: int, process_id: int) -> Leader | Follower | None:
    """`initialize`, then the op channel: process 0's Leader, another's Follower; None for one process."""
    if not initialize(coordinator, num_processes, process_id):
        return None
    return Leader.open(coordinator, num_processes) if process_id == 0 else Follower.connect(coordinator, process_id)


def shutdown() -> None:
    """Leave the group (a barrier: every process calls it once the leader stopped)."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


# ---- start-up ------------------------------------------------------------------------
def _handshake(port: int = 0, token: bytes = bytes(16)) -> tuple[int, bytes]:
    """Every process: the leader's (port, token), broadcast from process 0 (a collective)."""
    from jax.experimental import multihost_utils

    words = np.frombuffer(token, np.int32)
    got = np.asarray(multihost_utils.broadcast_one_to_all(np.concatenate([[port], words]).astype(np.int32)))
    return int(got[0]), got[1:].astype(np.int32).tobytes()


def _host(coordinator: str) -> str:
    return coordinator.rsplit(":", 1)[0].strip("[]")


# ---- the leader's end ------------------------------------------------------------------
class Leader:
    """The device op log: LeaderEngine calls it right before each device call; every follower
    receives the call and makes it too. Engine-thread only (one writer)."""

    def __init__(self, socks: list[socket.socket], on_lost=None):
        self._socks, self._closed = socks, False
        self._lock = threading.Lock()  # one frame at a time (the engine thread; close from another)
        self._on_lost = on_lost or (lambda: os._exit(EXIT_LOST))
        self.ops_sent = 0
        atexit.register(self.close)  # a leader that exits, however, stops its followers (before JAX's own exit)
        for i, s in enumerate(socks):
            threading.Thread(target=self._watch, args=(s, i + 1), name=f"follower-{i + 1}", daemon=True).start()

    @classmethod
    def open(cls, coordinator: str, num_processes: int, timeout: float = CONNECT_SECONDS, on_lost=None) -> Leader:
        """Listen, hand the port and a token to every process, accept each follower once."""
        host = _host(coordinator)
        loopback = host in ("localhost", "127.0.0.1", "::1")
        listener = socket.create_server(("127.0.0.1" if loopback else "", env.MULTIHOST_PORT.get() or 0))
        listener.settimeout(timeout)
        token = secrets.token_bytes(16)
        _handshake(listener.getsockname()[1], token)
        socks: dict[int, socket.socket] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(socks) < num_processes - 1:
                listener.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    raise TimeoutError(f"{num_processes - 1 - len(socks)} follower(s) did not connect to the leader "
                                       f"within {timeout:.0f} s") from None
                conn.settimeout(10.0)
                try:
                    op, meta, _ = recv(conn, limit=4096)
                except (LeaderGone, OSError, ValueError):
                    conn.close()
                    continue
                pid = meta.get("process_id")
                if (op != "hello" or meta.get("token") != token.hex() or not isinstance(pid, int)
                        or not 0 < pid < num_processes or pid in socks):
                    conn.close()  # not one of ours: keep waiting for the real followers
                    continue
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                socks[pid] = conn
        finally:
            listener.close()
        return cls([socks[p] for p in sorted(socks)], on_lost)

    def _watch(self, sock: socket.socket, pid: int) -> None:
        """Followers never write after hello: end of file means the follower is gone."""
        try:
            gone = sock.recv(1) == b""
        except OSError:
            gone = True
        if gone and not self._closed:
            print(f"pddjax multi-host: follower process {pid} is gone; this instance cannot step without its devices, "
                  f"exiting so that the group restarts", file=sys.stderr, flush=True)
            self._on_lost()

    def _broadcast(self, op: str, meta: dict, arrays: list) -> None:
        host = [np.asarray(a) for a in arrays]
        with self._lock:
            if self._closed:
                raise RuntimeError("this multi-host instance's followers were stopped: no more device calls")
            for s in self._socks:
                send(s, op, meta, host)
            self.ops_sent += 1

    def step(self, batch: PackedBatch, sampling: tuple, *, max_q_len: int, greedy: bool) -> None:
        self._broadcast("step", {"max_q_len": max_q_len, "greedy": bool(greedy)},
                        [*jax.tree_util.tree_leaves(batch), *sampling])

    def import_kv(self, run, pages: list[int]) -> None:
        pieces = as_pieces(run)
        meta = {"pages": [int(p) for p in pages],
                "pieces": [{"start": r.start, "head_start": r.head_start, "dtype": r.dtype,
                            "fingerprint": r.fingerprint} for r in pieces]}
        self._broadcast("import", meta, [a for r in pieces for a in (r.k, r.v)])

    def export_kv(self, pages: list[int], start: int, end: int) -> None:
        self._broadcast("export", {"pages": [int(p) for p in pages], "start": start, "end": end}, [])

    def close(self) -> None:
        """Tell every follower to stop; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for s in self._socks:
                try:
                    send(s, "stop", {}, [])
                    s.shutdown(socket.SHUT_WR)
                except OSError:
                    pass


class LeaderEngine(PagedEngine):
    """Process 0's engine: each device call (a step, a KV import's write, a KV export's read)
    told to every follower through `leader` just before it is made here."""

    def __init__(self, cfg, weights, fingerprint: str, config=None, *, leader: Leader):
        super().__init__(cfg, weights, fingerprint, config)
        self.leader = leader

    def _device_step(self, batch, sampling: tuple, *, max_q_len: int, greedy: bool):
        self.leader.step(batch, sampling, max_q_len=max_q_len, greedy=greedy)
        return super()._device_step(batch, sampling, max_q_len=max_q_len, greedy=greedy)

    def _write_kv(self, run, pages: list[int]) -> None:
        self.leader.import_kv(run, pages)
        super()._write_kv(run, pages)

    def _read_kv(self, pages: list[int], start: int, end: int) -> list[KVRun]:
        self.leader.export_kv(pages, start, end)
        return super()._read_kv(pages, start, end)


# ---- a follower's end ------------------------------------------------------------------
class Follower:
    def __init__(self, sock: socket.socket):
        self._sock = sock

    @classmethod
    def connect(cls, coordinator: str, process_id: int, timeout: float = CONNECT_SECONDS) -> Follower:
        port, token = _handshake()
        sock = socket.create_connection((_host(coordinator), port), timeout=timeout)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        send(sock, "hello", {"process_id": process_id, "token": token.hex()}, [])
        sock.settimeout(None)  # an idle leader sends nothing for as long as it likes
        return cls(sock)

    def receive(self) -> tuple[str, dict, list[np.ndarray]]:
        """The next op (LeaderGone when the channel ends without a stop)."""
        try:
            return recv(self._sock)
        except OSError as e:
            raise LeaderGone(f"the leader's channel failed: {e}") from None

    def close(self) -> None:
        self._sock.close()


def _replay_step(engine, meta: dict, arrays: list[np.ndarray]) -> None:
    n = len(dataclasses.fields(PackedBatch))
    batch = PackedBatch(*arrays[:n])  # numpy, as the leader's step passes them (and precompile builds)
    sampling = tuple(arrays[n:])  # seeds, steps, temperature, top_k, top_p
    _, _, engine.pool = run_step(engine.weights, engine.cfg, batch, engine.pool, *sampling,
                                 max_q_len=meta["max_q_len"], impl=engine.config.attention, greedy=meta["greedy"],
                                 layout=engine.layout)


def _replay_import(engine, meta: dict, arrays: list[np.ndarray]) -> None:
    pieces = [KVRun(p["fingerprint"], p["start"], arrays[2 * i], arrays[2 * i + 1], p["dtype"], [], p["head_start"])
              for i, p in enumerate(meta["pieces"])]
    try:
        engine.pool = engine.layout.put_pool(import_run(engine.pool, pieces, meta["pages"], engine.fingerprint))
    except KVImportError:
        pass  # refused before any device call: the leader's same check refused it too (a bad peer, not a fault)


def _replay_export(engine, meta: dict, arrays: list[np.ndarray]) -> None:
    export_run(engine.pool, meta["pages"], meta["start"], meta["end"], engine.fingerprint)  # its part of the gather


REPLAY = {"step": _replay_step, "import": _replay_import, "export": _replay_export}


def follow(engine, channel: Follower, log=None) -> str:
    """Replay the leader's device calls on this process's engine (built and precompiled as the
    leader's) until the leader stops -> "stop", or "lost" (one log line) if its channel ends."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    while True:
        try:
            op, meta, arrays = channel.receive()
        except LeaderGone as e:
            log(f"pddjax multi-host: {e} without a stop; the leader is gone, this follower exits")
            return "lost"
        if op == "stop":
            return "stop"
        try:
            REPLAY[op](engine, meta, arrays)
        except Exception as e:
            log(f"pddjax multi-host: replaying the leader's {op} failed ({type(e).__name__}: {e}); this follower exits")
            channel.close()  # the leader's watcher learns at once
            raise
