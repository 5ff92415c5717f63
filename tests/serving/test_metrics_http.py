"""serving/metrics_http.py: a service's /metrics port as a stranger sees it. Idle sockets pin no
thread and are closed after the head deadline, more of them than the connection bound do not keep
a scrape out, a head sent a byte at a time is cut at the deadline, an oversized head is 431, and
only GET /metrics answers the registry."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from serving import metrics_http
from serving.metrics import ServiceMetrics

HEAD_SECONDS, MAX_CONNECTIONS, IDLE = 1.0, 16, 40


@pytest.fixture
def endpoint(monkeypatch):
    """A service's /metrics endpoint with a short head deadline and a small connection bound."""
    monkeypatch.setattr(metrics_http, "HEAD_SECONDS", HEAD_SECONDS)
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", MAX_CONNECTIONS)
    m = ServiceMetrics("prefill")
    url = m.serve_http("127.0.0.1", 0)
    yield url, int(url.rsplit(":", 1)[1].split("/")[0])
    if m.endpoint is not None:
        m.endpoint.close()


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes `sock` (EOF or reset) within `seconds`."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


def raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_idle_sockets_pin_no_thread_are_closed_and_a_scrape_still_succeeds(endpoint):
    url, port = endpoint
    threads = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(IDLE)]
    try:
        time.sleep(0.5)  # a thread-per-connection server has started one per socket by now
        assert threading.active_count() <= threads, "idle sockets pinned threads"
        text = urllib.request.urlopen(url, timeout=5).read().decode()  # past the bound: the oldest idle one yields
        assert "pddjax_rpc_inflight" in text
        deadline = time.monotonic() + HEAD_SECONDS + 2
        still_open = [s for s in idle if not closed_within(s, max(0.05, deadline - time.monotonic()))]
        assert not still_open, f"{len(still_open)} of {IDLE} silent sockets still open after the head deadline"
        assert "pddjax_rpc_inflight" in urllib.request.urlopen(url, timeout=5).read().decode()
    finally:
        for s in idle:
            s.close()


def test_a_head_sent_a_byte_at_a_time_is_cut_at_the_deadline(endpoint):
    _, port = endpoint
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        start = time.monotonic()
        cut = False
        for byte in request:
            try:
                s.send(bytes([byte]))
            except OSError:
                cut = True
                break
            if closed_within(s, 0.1):
                cut = True
                break
        assert cut, "the server kept a dribbling head open for its whole length"
        assert time.monotonic() - start < HEAD_SECONDS + 1.5


def test_an_oversized_head_is_431(endpoint):
    _, port = endpoint
    headers = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(32))
    out = raw(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert out.startswith(b"HTTP/1.1 431 "), out[:80]


def test_only_get_metrics_answers_the_registry(endpoint):
    url, port = endpoint
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url.replace("/metrics", "/other"), timeout=5)
    assert e.value.code == 404
    assert raw(port, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n").startswith(b"HTTP/1.1 405 ")
    assert raw(port, b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    head = raw(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
