"""Who may join a multi-host instance's op channel (engines/multihost.py), and how they prove it.

Every connection, follower to leader, passes two checks before any op crosses it:
- TLS (`ChannelTLS`, when the service has a TLS directory): mutual TLS 1.3 with the role's own
  certificate on both ends; each end requires the other's certificate to chain to the CA and to
  name the same role (its SPIFFE ID, the URI SAN `serving/certs.py` writes). The ops and the KV
  they carry are encrypted. The SPIFFE ID is checked instead of a host name: the leader is dialled
  at the coordinator's address, which a certificate need not list.
- A challenge on the instance's key (both modes): the 128-bit token process 0 draws and every
  process receives by `jax.distributed` at start. The leader sends a nonce; the follower answers
  hello {process_id, its nonce, HMAC(key, follower | id | both nonces)}; the leader answers
  welcome {HMAC(key, leader | id | both nonces)}. Each end checks the other's MAC (constant-time),
  so neither a follower nor a leader can be posed as without the key, and no MAC replays (fresh
  nonces); the key itself never crosses the channel.
Without TLS the ops cross in plaintext (authenticated at the handshake only): `channel_problem`
refuses that off loopback unless the service is told `insecure`, as the gRPC listen rules do.

The leader accepts for `timeout` seconds; each connection's handshake runs in its own thread and
must finish within HANDSHAKE_SECONDS, so a peer that connects and dribbles bytes (or none) holds
one thread for that long and never the accept loop; at most MAX_HANDSHAKES run at once (more are
closed at once; a follower retries its dial until its own deadline).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import queue
import secrets
import socket
import ssl
import sys
import threading
import time

from pddjax.addresses import is_loopback
from pddjax.engines.multihost_frames import FrameError, LeaderGone, recv, send

HANDSHAKE_SECONDS = 10.0  # one connection's TLS handshake and challenge, all of it
MAX_HANDSHAKES = 64  # connections in their handshake at once on the leader
HELLO_BYTES = 4096  # a handshake frame at most
RETRY_SECONDS = 0.5  # a follower's pause between dials


class ChannelRefused(ConnectionError):
    """A peer failed the channel's checks (wrong certificate, role or key): one sentence."""


@dataclasses.dataclass(frozen=True)
class ChannelTLS:
    """The service's TLS identity, as files (the CA, its certificate, its key), and the SPIFFE ID
    the other end must present (its own role's)."""
    ca: str
    cert: str
    key: str
    peer_id: str

    def context(self, server: bool) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False  # the peer's SPIFFE ID is checked instead (`check_peer`)
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def check_peer(self, sock: ssl.SSLSocket) -> None:
        names = (sock.getpeercert() or {}).get("subjectAltName", ())
        if ("URI", self.peer_id) not in names:
            raise ChannelRefused(f"the peer's certificate does not name {self.peer_id}")


def channel_problem(host: str, tls: bool, insecure: bool) -> str | None:
    """One sentence on why the op channel must not run this way, or None."""
    if tls or insecure or is_loopback(host):
        return None
    return (f"refusing to run a multi-host instance's op channel in plaintext across hosts (coordinator {host}): "
            f"give a TLS directory (--tls-dir or PDDJAX_TLS_DIR) or pass --insecure (config: insecure = true)")


def share_key(port: int = 0, key: bytes = bytes(16)) -> tuple[int, bytes]:
    """Every process of the instance: the leader's (port, key), broadcast from process 0 (a
    jax.distributed collective; the others pass nothing)."""
    import numpy as np
    from jax.experimental import multihost_utils

    words = np.frombuffer(key, np.int32)
    got = np.asarray(multihost_utils.broadcast_one_to_all(np.concatenate([[port], words]).astype(np.int32)))
    return int(got[0]), got[1:].astype(np.int32).tobytes()


def _mac(key: bytes, who: str, pid: int, nonce_l: str, nonce_f: str) -> str:
    return hmac.new(key, f"pddjax-op-channel|{who}|{pid}|{nonce_l}|{nonce_f}".encode(), hashlib.sha256).hexdigest()


def _secure(conn: socket.socket, tls: ChannelTLS | None, server: bool, deadline: float) -> socket.socket:
    if tls is None:
        return conn
    conn.settimeout(max(0.01, deadline - time.monotonic()))  # the whole TLS handshake (CPython's deadline)
    s = tls.context(server).wrap_socket(conn, server_side=server)
    tls.check_peer(s)
    return s


def _welcome(conn: socket.socket, key: bytes, tls: ChannelTLS | None, num_processes: int) -> tuple[int, socket.socket]:
    """The leader's side of one connection's handshake -> (process id, the channel's socket)."""
    deadline = time.monotonic() + HANDSHAKE_SECONDS
    s = _secure(conn, tls, True, deadline)
    nonce_l = secrets.token_hex(16)
    s.settimeout(max(0.01, deadline - time.monotonic()))
    send(s, "challenge", {"nonce": nonce_l}, [])
    op, meta, _ = recv(s, HELLO_BYTES, deadline, arrays_allowed=False)
    pid, nonce_f, mac = meta.get("process_id"), meta.get("nonce"), meta.get("mac")
    if op != "hello" or not isinstance(pid, int) or not 0 < pid < num_processes or not isinstance(nonce_f, str) \
            or not isinstance(mac, str) or len(nonce_f) != 32:
        raise ChannelRefused("the peer's hello is not a follower's")
    if not hmac.compare_digest(mac.encode(), _mac(key, "follower", pid, nonce_l, nonce_f).encode()):
        raise ChannelRefused(f"the peer claiming process {pid} does not hold this instance's key")
    send(s, "welcome", {"mac": _mac(key, "leader", pid, nonce_l, nonce_f)}, [])
    return pid, s


def accept_followers(listener: socket.socket, num_processes: int, key: bytes, tls: ChannelTLS | None,
                     timeout: float, log=None) -> dict[int, socket.socket]:
    """Accept until every follower 1..num_processes-1 passed its handshake -> {process id: socket};
    TimeoutError (one sentence) past `timeout`. Refused peers are closed and logged; they hold
    nothing up."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    done: queue.Queue = queue.Queue()
    slots = threading.BoundedSemaphore(MAX_HANDSHAKES)

    def handshake(conn: socket.socket, addr) -> None:
        try:
            done.put(_welcome(conn, key, tls, num_processes))
        except (ChannelRefused, FrameError, LeaderGone, OSError, ValueError) as e:
            conn.close()
            log(f"pddjax multi-host: refused a connection to the op channel from {addr[0]}: "
                f"{e or type(e).__name__}")
        finally:
            slots.release()

    socks: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout
    listener.settimeout(0.05)
    try:
        while len(socks) < num_processes - 1:
            while not done.empty():
                pid, s = done.get()
                if pid in socks:
                    s.close()  # a second claim to a process already in: the first one stays
                else:
                    socks[pid] = s
            if len(socks) == num_processes - 1:
                break
            if time.monotonic() > deadline:
                missing = num_processes - 1 - len(socks)
                raise TimeoutError(f"{missing} follower(s) did not join the leader's op channel within {timeout:.0f} s")
            try:
                conn, addr = listener.accept()
            except TimeoutError:
                continue
            if not slots.acquire(blocking=False):
                conn.close()  # too many handshakes at once: the real follower dials again
                continue
            threading.Thread(target=handshake, args=(conn, addr), name="op-channel-handshake", daemon=True).start()
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    return socks


def _join(host: str, port: int, pid: int, key: bytes, tls: ChannelTLS | None, deadline: float) -> socket.socket:
    conn = socket.create_connection((host, port), timeout=max(0.01, deadline - time.monotonic()))
    try:
        s = _secure(conn, tls, False, deadline)
        op, meta, _ = recv(s, HELLO_BYTES, deadline, arrays_allowed=False)
        nonce_l, nonce_f = meta.get("nonce"), secrets.token_hex(16)
        if op != "challenge" or not isinstance(nonce_l, str) or len(nonce_l) != 32:
            raise ChannelRefused(f"{host}:{port} did not answer as a multi-host leader")
        send(s, "hello", {"process_id": pid, "nonce": nonce_f, "mac": _mac(key, "follower", pid, nonce_l, nonce_f)}, [])
        op, meta, _ = recv(s, HELLO_BYTES, deadline, arrays_allowed=False)
        mac = meta.get("mac")
        if op != "welcome" or not isinstance(mac, str) or \
                not hmac.compare_digest(mac.encode(), _mac(key, "leader", pid, nonce_l, nonce_f).encode()):
            raise ChannelRefused(f"{host}:{port} does not hold this instance's key: not its leader")
        return s
    except BaseException:
        conn.close()
        raise


def dial_leader(host: str, port: int, pid: int, key: bytes, tls: ChannelTLS | None, timeout: float) -> socket.socket:
    """A follower's channel to its leader, both ends checked; dialled again after a connection
    failure until `timeout`. ChannelRefused (at once) when the other end fails a check; the
    connection's failure (one sentence) at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _join(host, port, pid, key, tls, min(deadline, time.monotonic() + HANDSHAKE_SECONDS))
        except (ChannelRefused, ssl.SSLError) as e:  # (both OSErrors: caught before the next line)
            if isinstance(e, ChannelRefused):
                raise
            if not isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
                raise ChannelRefused(f"the leader's op channel at {host}:{port} refused TLS: {e}") from None
            failure = e  # closed mid-handshake (a leader with too many at once): dial again
        except (FrameError, LeaderGone, OSError) as e:
            failure = e
        if time.monotonic() + RETRY_SECONDS > deadline:
            raise ConnectionError(f"follower {pid} could not join the leader's op channel at {host}:{port} "
                                  f"within {timeout:.0f} s: {failure or type(failure).__name__}") from None
        time.sleep(RETRY_SECONDS)
