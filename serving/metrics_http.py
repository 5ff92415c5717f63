"""The /metrics endpoint of a service process, bounded against whoever can reach its port.

One daemon thread runs an asyncio server, so an open connection costs a socket, never a thread.
Each connection has HEAD_SECONDS in all to send its request head (one that sends nothing, or
sends it a byte at a time, is closed), a head of at most MAX_HEAD_BYTES (a longer one: 431), and
WRITE_SECONDS to take the answer. At most MAX_CONNECTIONS are open at once: a new connection
closes the oldest one still sending its head, so a flood of idle sockets cannot keep a scrape
out. GET (or HEAD) /metrics answers the registry in Prometheus' text format; another path is
404, another method 405, a head that is not HTTP 400; every answer closes the connection.
"""

from __future__ import annotations

import asyncio
import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

HEAD_SECONDS = 5.0  # the whole request head, from connect to its blank line
WRITE_SECONDS = 10.0  # the whole answer taken by the client
MAX_HEAD_BYTES = 8192
MAX_CONNECTIONS = 64
PATHS = (b"/metrics", b"/")


def _answer(status: str, body: bytes = b"", content_type: str = "text/plain; charset=utf-8",
            head_only: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode()
    return head if head_only else head + body


class MetricsEndpoint:
    """Serves `registry` on host:port (0: any free port) from its own thread until `close()`."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0):
        self.registry = registry
        self.head_seconds, self.write_seconds = HEAD_SECONDS, WRITE_SECONDS
        self.max_head_bytes, self.max_connections = MAX_HEAD_BYTES, MAX_CONNECTIONS
        self._pending: dict[asyncio.StreamWriter, None] = {}  # still sending their heads, oldest first
        self._open = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._error: OSError | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(host, port, started), name="pddjax-metrics",
                                        daemon=True)
        self._thread.start()
        started.wait()
        if self._error is not None:
            raise self._error
        self.port: int = self._server.sockets[0].getsockname()[1]

    def _run(self, host: str, port: int, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._connection, host, port, limit=self.max_head_bytes))
        except OSError as e:
            self._error = e
            started.set()
            return
        started.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def stop():
            self._server.close()
            for w in list(self._pending):
                w.transport.abort()

        if self._server is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        if self._open >= self.max_connections:
            if not self._pending:
                return False  # every slot is answering a request: this one waits for the next scrape
            oldest = next(iter(self._pending))
            self._pending.pop(oldest)
            oldest.transport.abort()
        self._open += 1
        self._pending[writer] = None
        return True

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._admit(writer):
            writer.transport.abort()
            return
        try:
            try:
                async with asyncio.timeout(self.head_seconds):
                    head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.LimitOverrunError, ValueError):
                self._pending.pop(writer, None)
                await self._send(writer, _answer("431 Request Header Fields Too Large", b"request head too large\n"))
                return
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                return  # silent, slow or gone: closed below
            if self._pending.pop(writer, False) is False:
                return  # closed for a newer connection meanwhile
            await self._send(writer, self._respond(head))
        finally:
            self._pending.pop(writer, None)
            self._open -= 1
            writer.close()

    def _respond(self, head: bytes) -> bytes:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return _answer("400 Bad Request", b"not an HTTP/1 request\n")
        method, path = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return _answer("405 Method Not Allowed", b"only GET /metrics\n")
        if path not in PATHS:
            return _answer("404 Not Found", b"only /metrics\n")
        return _answer("200 OK", generate_latest(self.registry), CONTENT_TYPE_LATEST, head_only=method == b"HEAD")

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        try:
            async with asyncio.timeout(self.write_seconds):
                await writer.drain()
        except (TimeoutError, ConnectionError):
            writer.transport.abort()
