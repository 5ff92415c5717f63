"""The op channel's frames (engines/multihost_frames.py) as an attacker or a broken peer sends
them, in process over socket pairs: a length prefix or array shapes past the channel's limit are
refused before anything is allocated (FrameError, on the follower: `follow` -> "lost" with one
line), malformed headers likewise; the sending side refuses an oversized frame before writing a
byte, so the channel stays in step and the next op goes through."""

from __future__ import annotations

import json
import socket
import struct
import threading

import numpy as np
import pytest

from pddjax.engines import multihost
from pddjax.engines.multihost_frames import FrameError, recv, send

pytestmark = pytest.mark.timeout(30)
LIMIT = 1 << 20


def raw_header(sock: socket.socket, header) -> None:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    sock.sendall(struct.pack("!I", len(body)) + body)


def test_a_huge_length_prefix_is_refused_before_it_is_read():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("!I", 0xFFFFFFF0))  # and nothing more: a reader that trusted it would wait
        b.settimeout(5)
        with pytest.raises(FrameError, match="over this channel's limit"):
            recv(b, LIMIT)


def test_arrays_past_the_limit_are_refused_before_they_are_allocated():
    """The follower's receive: a header claiming 256 MiB of float32 over a 1 MiB channel."""
    a, b = socket.socketpair()
    channel = multihost.Follower.__new__(multihost.Follower)
    channel._sock, channel.max_frame = b, LIMIT
    lines = []
    with a:
        raw_header(a, {"op": "import", "meta": {}, "arrays": [["float32", [1 << 26]]]})
        a.shutdown(socket.SHUT_WR)  # no array bytes follow: a reader that allocated would then see end of file
        assert multihost.follow(None, channel, log=lines.append) == "lost"
    assert len(lines) == 1 and "bad frame" in lines[0] and "over this channel's limit" in lines[0], lines


@pytest.mark.parametrize("header, says", [
    (b"\xff{not json", "not JSON"),
    ({"op": "step", "meta": {}, "arrays": [["object", [1]]]}, "known dtype"),
    ({"op": "step", "meta": {}, "arrays": [["int32", [-4]]]}, "known dtype"),
    ({"op": "step", "meta": {}, "arrays": [["int32", [1 << 40, 1 << 40]]]}, "over this channel's limit"),
    ({"op": "step", "meta": [], "arrays": []}, "op, meta and arrays"),
    ([1, 2], "op, meta and arrays"),
], ids=["not json", "object dtype", "negative dim", "overflowing shape", "meta not a dict", "not an object"])
def test_malformed_headers_are_refused(header, says):
    a, b = socket.socketpair()
    with a, b:
        raw_header(a, header)
        b.settimeout(5)
        with pytest.raises(FrameError, match=says):
            recv(b, LIMIT)


def test_a_frame_within_the_limit_round_trips():
    a, b = socket.socketpair()
    arrays = [np.arange(12, dtype=np.int32).reshape(3, 4), np.ones(5, np.float16), np.zeros((0, 2), np.float32)]
    with a, b:
        t = threading.Thread(target=send, args=(a, "step", {"greedy": True}, arrays, LIMIT))
        t.start()
        b.settimeout(5)
        op, meta, got = recv(b, LIMIT)
        t.join(5)
    assert (op, meta) == ("step", {"greedy": True})
    assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(arrays, got, strict=True))


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    return a, b


def test_the_leader_refuses_an_oversized_frame_before_a_byte_and_stays_in_step():
    lead, follower = tcp_pair()
    leader = multihost.Leader([lead], on_lost=lambda: pytest.fail("an oversized frame is not a lost follower"))
    leader.max_frame = LIMIT
    with lead, follower:
        with pytest.raises(FrameError, match="over this channel's limit"):
            leader._broadcast("import", {}, [np.zeros(LIMIT, np.float32)])
        follower.settimeout(0.2)
        with pytest.raises(TimeoutError):
            follower.recv(1)  # nothing was written
        leader.export_kv([1, 2], 0, 3)  # the next op goes through whole
        follower.settimeout(5)
        assert recv(follower, LIMIT)[:2] == ("export", {"pages": [1, 2], "start": 0, "end": 3})
        assert leader.ops_sent == 1
        leader.close()
