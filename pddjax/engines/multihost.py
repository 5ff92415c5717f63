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

Both sides build and precompile their engine the same way before the log starts. The log is a
host channel: one TCP connection from each follower to the leader, whose port (any free one;
`PDDJAX_MULTIHOST_PORT` fixes it) and a 128-bit key reach every process by one
`broadcast_one_to_all` at start. Each connection is mutual TLS with the role's certificates when
the service has a TLS directory, and passes a challenge on the key both ways (plaintext off
loopback only with `insecure`; engines/multihost_channel.py). An op is one frame
(engines/multihost_frames.py: a JSON header, then the arrays' bytes) of at most `frame_limit`
bytes, checked on both ends. Not `broadcast_one_to_all` per op: that is a collective and a
compiled program per array shape, and an idle follower would wait inside it (gloo times out).
A step sends a few KB; an import carries its whole KV run (each follower keeps its shards).

Failures: the leader gone (its socket closes without a stop) or a bad frame -> `follow` returns
"lost" after one log line and the process exits 3; a follower gone, or one that takes no 1 MiB of
an op for `PDDJAX_MULTIHOST_WRITE_SECONDS` (instead of wedging the engine while health says
SERVING) -> the leader logs one line and exits 3 (a LeaderWorkerSet restarts the group). A host
that vanishes without closing its sockets is caught by JAX's coordination service, which aborts
every process of the instance after `PDDJAX_HEARTBEAT_SECONDS` (default 30) without heartbeats.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import secrets
import select
import socket
import sys
import threading

import jax
import numpy as np

from pddjax import env
from pddjax.addresses import host_of, is_loopback
from pddjax.engines.multihost_channel import ChannelTLS, accept_followers, channel_problem, dial_leader, share_key
from pddjax.engines.multihost_frames import FrameError, LeaderGone, frame_limit, recv, send
from pddjax.engines.paged_engine import PagedEngine
from pddjax.engines.step import run_step
from pddjax.errors import UserError
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


def join(coordinator: str | None, num_processes: int, process_id: int, tls: ChannelTLS | None = None,
         insecure: bool = False) -> Leader | Follower | None:
    """`initialize`, then the op channel (mutual TLS with `tls`; without it plaintext, refused off
    loopback unless `insecure`: UserError): process 0's Leader, another's Follower; None for one process."""
    if num_processes > 1:
        problem = channel_problem(host_of(coordinator or ""), tls is not None, insecure)
        if problem:
            raise UserError(problem)
    if not initialize(coordinator, num_processes, process_id):
        return None
    if process_id == 0:
        return Leader.open(coordinator, num_processes, tls=tls)
    return Follower.connect(coordinator, process_id, tls=tls)


def shutdown() -> None:
    """Leave the group (a barrier: every process calls it once the leader stopped)."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


# ---- start-up ------------------------------------------------------------------------
# ---- the leader's end ------------------------------------------------------------------
class Leader:
    """The device op log: LeaderEngine calls it right before each device call; every follower
    receives the call and makes it too. Engine-thread only (one writer)."""

    def __init__(self, socks: list[socket.socket], on_lost=None, write_seconds: float | None = None):
        self._socks, self._closed, self._lost = socks, False, False
        self._lock = threading.Lock()  # one frame at a time (the engine thread; close from another)
        self._fail_lock = threading.Lock()
        self._on_lost = on_lost or (lambda: os._exit(EXIT_LOST))
        self.write_seconds = write_seconds or env.MULTIHOST_WRITE_SECONDS.get()
        self.max_frame: int | None = None  # LeaderEngine sets its engine's `frame_limit`
        self.ops_sent = 0
        atexit.register(self.close)  # a leader that exits, however, stops its followers (before JAX's own exit)
        for i, s in enumerate(socks):
            s.settimeout(self.write_seconds)  # each CHUNK of a frame (multihost_frames.send)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._watch, args=(s, i + 1), name=f"follower-{i + 1}", daemon=True).start()

    @classmethod
    def open(cls, coordinator: str, num_processes: int, timeout: float = CONNECT_SECONDS, on_lost=None,
             tls: ChannelTLS | None = None) -> Leader:
        """Listen, hand the port and the key to every process, accept each follower once."""
        loopback = is_loopback(host_of(coordinator))
        listener = socket.create_server(("127.0.0.1" if loopback else "", env.MULTIHOST_PORT.get() or 0))
        key = secrets.token_bytes(16)
        try:
            share_key(listener.getsockname()[1], key)
            socks = accept_followers(listener, num_processes, key, tls, timeout)
        finally:
            listener.close()
        how = "over mutual TLS" if tls else "in plaintext (loopback or insecure), each past the key's challenge"
        print(f"pddjax multi-host: {len(socks)} follower(s) joined the op channel {how}", file=sys.stderr, flush=True)
        return cls([socks[p] for p in sorted(socks)], on_lost)

    def _fail(self, line: str) -> None:
        """One line, then the instance ends (`on_lost`), once however many threads see it."""
        with self._fail_lock:
            if self._lost:
                return
            self._lost = True
        print(line, file=sys.stderr, flush=True)
        self._on_lost()

    def _watch(self, sock: socket.socket, pid: int) -> None:
        """Followers never write after hello: anything readable (end of file, above all) means the
        follower is gone. Polled, not read: the engine thread owns the socket (and its TLS)."""
        poll = select.poll()
        poll.register(sock.fileno(), select.POLLIN | select.POLLPRI)
        poll.poll()
        if not self._closed:
            self._fail(f"pddjax multi-host: follower process {pid} is gone; this instance cannot step without its "
                       f"devices, exiting so that the group restarts")

    def _broadcast(self, op: str, meta: dict, arrays: list) -> None:
        host = [np.asarray(a) for a in arrays]
        with self._lock:
            if self._closed:
                raise RuntimeError("this multi-host instance's followers were stopped: no more device calls")
            for pid, s in enumerate(self._socks, 1):
                try:
                    send(s, op, meta, host, self.max_frame)  # FrameError (too large) before a byte to anyone
                except FrameError:
                    raise
                except OSError as e:  # a partial frame: this follower is out of step for good
                    self._closed = True
                    why = (f"took no bytes of a {op} for {self.write_seconds:g} s" if isinstance(e, TimeoutError)
                           else f"failed ({e})")
                    line = (f"pddjax multi-host: the channel to follower process {pid} {why}; this instance cannot "
                            f"step without it, exiting so that the group restarts")
                    self._fail(line)
                    raise RuntimeError(line) from None
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
        leader.max_frame = frame_limit(self)

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
        self.max_frame: int | None = None  # `follow` sets its engine's `frame_limit`
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.settimeout(None)  # an idle leader sends nothing for as long as it likes

    @classmethod
    def connect(cls, coordinator: str, process_id: int, timeout: float = CONNECT_SECONDS,
                tls: ChannelTLS | None = None) -> Follower:
        port, key = share_key()
        return cls(dial_leader(host_of(coordinator), port, process_id, key, tls, timeout))

    def receive(self) -> tuple[str, dict, list[np.ndarray]]:
        """The next op (LeaderGone when the channel ends without a stop; FrameError for a bad frame)."""
        try:
            return recv(self._sock, self.max_frame)
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
    if engine is not None:
        channel.max_frame = frame_limit(engine)
    while True:
        try:
            op, meta, arrays = channel.receive()
        except LeaderGone as e:
            log(f"pddjax multi-host: {e} without a stop; the leader is gone, this follower exits")
            return "lost"
        except FrameError as e:
            log(f"pddjax multi-host: the leader's channel sent a bad frame ({e}); this follower exits")
            channel.close()
            return "lost"
        if op == "stop":
            return "stop"
        try:
            REPLAY[op](engine, meta, arrays)
        except Exception as e:
            log(f"pddjax multi-host: replaying the leader's {op} failed ({type(e).__name__}: {e}); this follower exits")
            channel.close()  # the leader's watcher learns at once
            raise
