"""Who gets onto a multi-host instance's op channel (engines/multihost_channel.py), in process
over loopback sockets, as an attacker would try it: a peer that connects and dribbles bytes
does not keep the real follower out and is cut off at its handshake deadline; a peer without
the instance's key is refused by the leader, and a "leader" without it is refused by the
follower (the key itself never crosses); with TLS, a peer with another role's certificate, a
foreign CA's or none is refused both ways, and the real pair gets TLS 1.3; a follower that stops
reading fails the leader loudly (one sentence, `on_lost`) within its write timeout instead of
wedging it; plaintext across hosts is refused unless `insecure`."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import numpy as np
import pytest

from pddjax.engines import multihost, multihost_channel
from pddjax.engines.multihost_channel import ChannelRefused, ChannelTLS, accept_followers, dial_leader
from pddjax.engines.multihost_frames import recv, send
from pddjax.errors import UserError

pytestmark = pytest.mark.timeout(60)
KEY = bytes(range(16))
MAIN = "spiffe://pddjax/role/main"


@pytest.fixture(scope="module")
def op_certs(tmp_path_factory):
    """ca.pem + every role's certificate, and a `main` certificate of another CA."""
    from serving.certs import DevCA, make_dev_certs

    d = tmp_path_factory.mktemp("op-tls")
    make_dev_certs(str(d))
    cert, key = DevCA().issue("main")
    (d / "foreign.pem").write_bytes(cert)
    (d / "foreign-key.pem").write_bytes(key)
    return d


def identity(d, name: str) -> ChannelTLS:
    return ChannelTLS(str(d / "ca.pem"), str(d / f"{name}.pem"), str(d / f"{name}-key.pem"), MAIN)


class Accepting:
    """`accept_followers` for one follower in a thread: `.result` (or `.error`), refusals logged."""

    def __init__(self, key=KEY, tls=None, timeout=20.0):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.result, self.error, self.refusals = None, None, []
        self.thread = threading.Thread(target=self._run, args=(key, tls, timeout), daemon=True)
        self.thread.start()

    def _run(self, key, tls, timeout):
        try:
            self.result = accept_followers(self.listener, 2, key, tls, timeout, log=self.refusals.append)
        except Exception as e:
            self.error = e
        finally:
            self.listener.close()

    def refused(self, within: float) -> bool:
        end = time.monotonic() + within
        while not self.refusals and time.monotonic() < end:
            time.sleep(0.02)
        return bool(self.refusals)

    def joined(self, within: float) -> dict:
        self.thread.join(within)
        assert not self.thread.is_alive(), f"the follower was not accepted within {within} s"
        assert self.error is None, self.error
        return self.result


def test_a_dribbling_peer_neither_keeps_the_follower_out_nor_stays(monkeypatch):
    monkeypatch.setattr(multihost_channel, "HANDSHAKE_SECONDS", 1.5)
    acc = Accepting()
    dribbler = socket.create_connection(("127.0.0.1", acc.port))
    dribbler.sendall(b"\x00")  # the start of a hello's length, one byte at a time below
    t0 = time.monotonic()
    sock = dial_leader("127.0.0.1", acc.port, 1, KEY, None, timeout=5)  # while the dribbler holds its connection
    assert set(acc.joined(within=1.0)) == {1} and time.monotonic() - t0 < 1.0
    sock.close()
    dribbler.settimeout(0.1)
    cut = None
    while time.monotonic() - t0 < 4.0:  # it keeps dribbling; the leader ends it at its handshake deadline
        try:
            dribbler.sendall(b"\x00")
            if dribbler.recv(4096) == b"":
                cut = time.monotonic() - t0
                break
        except TimeoutError:
            pass  # (the challenge came: read, then nothing until the cut)
        except OSError:
            cut = time.monotonic() - t0
            break
    dribbler.close()
    assert cut is not None and cut < 3.0, "the dribbling peer was not cut off at the handshake deadline"


def test_a_follower_without_the_key_is_refused_and_the_real_one_gets_in():
    acc = Accepting()
    with pytest.raises(ConnectionError):
        dial_leader("127.0.0.1", acc.port, 1, bytes(16), None, timeout=0.4)
    assert acc.refused(within=2.0), "the leader did not record the refusal"  # (recorded after the cut)
    assert acc.result is None and acc.thread.is_alive()
    assert any("does not hold this instance's key" in r for r in acc.refusals), acc.refusals
    sock = dial_leader("127.0.0.1", acc.port, 1, KEY, None, timeout=5)
    assert set(acc.joined(within=2.0)) == {1}
    sock.close()


def test_a_leader_without_the_key_is_refused_and_learns_nothing():
    """Whoever answers at the leader's port: the follower's hello carries no key, and a welcome
    without the key's MAC is refused."""
    seen = {}
    with socket.create_server(("127.0.0.1", 0)) as srv:
        def impostor():
            conn, _ = srv.accept()
            with conn:
                send(conn, "challenge", {"nonce": "0" * 32}, [])
                seen["hello"] = recv(conn, 4096)
                send(conn, "welcome", {"mac": "0" * 64}, [])

        t = threading.Thread(target=impostor, daemon=True)
        t.start()
        with pytest.raises(ChannelRefused, match="does not hold this instance's key"):
            dial_leader("127.0.0.1", srv.getsockname()[1], 1, KEY, None, timeout=5)
        t.join(5)
    op, meta, _ = seen["hello"]
    assert op == "hello" and KEY.hex() not in str(meta) and set(meta) == {"process_id", "nonce", "mac"}


@pytest.mark.parametrize("who", ["router", "foreign", "plaintext"])
def test_with_tls_a_follower_without_the_role_certificate_is_refused(op_certs, who):
    acc = Accepting(tls=identity(op_certs, "main"))
    with pytest.raises(ConnectionError):  # refused: the leader closes it (it dials until its deadline)
        dial_leader("127.0.0.1", acc.port, 1, KEY, None if who == "plaintext" else identity(op_certs, who), 0.4)
    assert acc.refused(within=3.0) and acc.result is None
    sock = dial_leader("127.0.0.1", acc.port, 1, KEY, identity(op_certs, "main"), timeout=5)
    got = acc.joined(within=2.0)
    assert isinstance(sock, ssl.SSLSocket) and sock.version() == "TLSv1.3"
    assert ("URI", MAIN) in got[1].getpeercert()["subjectAltName"]
    send(got[1], "step", {"n": 1}, [np.arange(3, dtype=np.int32)])
    assert recv(sock, 4096)[1] == {"n": 1}  # ops cross the encrypted channel
    sock.close()
    got[1].close()


@pytest.mark.parametrize("who", ["router", "foreign"])
def test_with_tls_a_leader_without_the_role_certificate_is_refused_at_once(op_certs, who):
    acc = Accepting(tls=identity(op_certs, who), timeout=5)
    t0 = time.monotonic()
    with pytest.raises(ChannelRefused):
        dial_leader("127.0.0.1", acc.port, 1, KEY, identity(op_certs, "main"), timeout=10)
    assert time.monotonic() - t0 < 3.0  # no retrying against the wrong leader until the deadline
    assert acc.result is None


def test_a_follower_that_stops_reading_fails_the_leader_loudly(capsys):
    with socket.create_server(("127.0.0.1", 0)) as srv:
        stalled = socket.create_connection(srv.getsockname())
        lead, _ = srv.accept()
    lost = threading.Event()
    leader = multihost.Leader([lead], on_lost=lost.set, write_seconds=0.5)
    errors = []

    def engine_thread():
        try:
            leader._broadcast("import", {}, [np.zeros(16 << 20, np.float32)])  # 64 MiB: past every buffer
        except RuntimeError as e:
            errors.append(str(e))

    t0 = time.monotonic()
    t = threading.Thread(target=engine_thread, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the leader's write to a stalled follower wedged"
    assert lost.is_set() and time.monotonic() - t0 < 5
    assert errors and "follower process 1 took no bytes of a import for 0.5 s" in errors[0], errors
    line = capsys.readouterr().err.strip().splitlines()
    assert line == [errors[0]]  # one sentence on stderr, then on_lost (the process exits 3)
    with pytest.raises(RuntimeError, match="were stopped"):
        leader.export_kv([1], 0, 1)  # out of step for good: no further op
    stalled.close()
    lead.close()


def test_a_follower_gone_ends_the_leader_with_one_line(capsys):
    with socket.create_server(("127.0.0.1", 0)) as srv:
        follower = socket.create_connection(srv.getsockname())
        lead, _ = srv.accept()
    lost = threading.Event()
    leader = multihost.Leader([lead], on_lost=lost.set, write_seconds=5)
    follower.close()
    assert lost.wait(5)
    assert "follower process 1 is gone" in capsys.readouterr().err
    leader._closed = True
    lead.close()


def test_plaintext_across_hosts_is_refused_unless_insecure():
    problem = multihost_channel.channel_problem
    assert "refusing to run a multi-host instance's op channel in plaintext" in problem("10.0.0.1", False, False)
    assert problem("10.0.0.1", True, False) is None and problem("10.0.0.1", False, True) is None
    assert problem("127.0.0.1", False, False) is None and problem("localhost", False, False) is None
    with pytest.raises(UserError, match="in plaintext across hosts"):
        multihost.join("10.0.0.1:8476", 2, 0)  # before jax.distributed starts


def test_the_service_hands_its_role_certificate_to_the_op_channel(op_certs, tmp_path, monkeypatch):
    from serving import security
    from serving.stack.server import op_channel_tls

    monkeypatch.delenv(security.TLS_DIR_ENV, raising=False)
    security.clear_caches()
    assert op_channel_tls("main") is None
    monkeypatch.setenv(security.TLS_DIR_ENV, str(op_certs))
    security.clear_caches()
    tls = op_channel_tls("main")
    assert (tls.cert, tls.key, tls.peer_id) == (str(op_certs / "main.pem"), str(op_certs / "main-key.pem"), MAIN)
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("ca.pem", "main.pem"):
        (broken / name).write_bytes((op_certs / name).read_bytes())
    (broken / "main-key.pem").write_text("not a key")
    monkeypatch.setenv(security.TLS_DIR_ENV, str(broken))
    security.clear_caches()
    with pytest.raises(UserError, match="cannot secure the multi-host op channel"):
        op_channel_tls("main")
    security.clear_caches()
