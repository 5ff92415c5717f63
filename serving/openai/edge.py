"""The gateway's bounds on what one HTTP client may hold: connections, header bytes and time,
body bytes and time. Everything past a bound is answered (or closed) before it costs memory or
a task, each refusal in OpenAI's error shape.

  - connections: at most MAX_CONNECTIONS open at once (past it: 503 and closed at once; a
    streamed answer holds one, so the bound sits above the router's max_inflight + max_queue);
  - a request's head (request line and headers): at most MAX_HEADER_BYTES (431 and closed) and
    HEADER_TIMEOUT_S from a connection's start or a request's first byte to its last header
    (closed): a socket that sends nothing, or dribbles a header, is let go;
  - its body: at most MAX_BODY_BYTES, refused from Content-Length before any is read and counted
    as a chunked one arrives (413, the rest unread, the connection closed), all of it within
    BODY_TIMEOUT_S (408). A refusal sent while the client is still sending its body is followed by
    a lingering close (as nginx's): the answer, then FIN, then what still arrives is discarded for
    at most LINGER_S / LINGER_BYTES, so the client reads the 413 instead of a connection reset.
`EdgeProtocol` is uvicorn's httptools protocol with the first two; `BodyLimit` is the ASGI
middleware with the third (it reads the body, then hands it to the app in one message).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from serving.openai.errors import OpenAIError

MAX_CONNECTIONS = 1024
MAX_HEADER_BYTES = 16 * 1024  # as h11's default bound on an incomplete event
HEADER_TIMEOUT_S = 10.0
# a prompt at the router's 1 Mi-character bound fits as UTF-8; parsing the worst body (4 MiB of
# one-digit ids) holds the loop ~0.13 s (json.loads holds the GIL: a thread would not help)
MAX_BODY_BYTES = 4 * 1024 * 1024
BODY_TIMEOUT_S = 30.0
LINGER_S, LINGER_BYTES = 1.0, 4 * 1024 * 1024


def error_bytes(status: int, message: str, type_: str, code: str) -> bytes:
    """A whole HTTP/1.1 response (connection: close) holding OpenAI's error JSON."""
    body = OpenAIError(status, message, type_, code=code).body().model_dump_json().encode()
    return b"".join([STATUS_LINE[status], b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body])


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a connection limit and a bounded request head."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_bytes, self._in_head, self._head_timer = 0, True, None
        self._head_parsed, self._head_refused = 0, False  # the head's url + header bytes the parser handed over
        self._head_done = False  # a head completed during the read being parsed
        self._lingering = None  # bytes discarded since a lingering close began (None: not lingering)
        if len(self.connections) > MAX_CONNECTIONS:
            self._refuse(error_bytes(503, f"the gateway holds {MAX_CONNECTIONS} connections, its limit: retry later",
                                     "service_unavailable", "too_many_connections"))
            return
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            self._lingering += len(data)  # the rest of a refused body: discarded, never parsed
            if self._lingering > LINGER_BYTES:
                self.transport.close()
            return
        idle = self.cycle is None or self.cycle.response_complete
        if self._head_timer is None and idle and not self.transport.is_closing():
            self._in_head = True  # bytes between requests: a new head starts (blank lines included)
            self._arm_head_timer()
        self._head_done = False
        super().data_received(data)
        if self._in_head and not self._head_done and not self.transport.is_closing():
            self._head_bytes += len(data)  # a read that completed no head
            if self._head_bytes > MAX_HEADER_BYTES:
                self._refuse(_head_too_large())

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_head(self, n: int) -> None:
        self._head_parsed += n
        if self._head_parsed > MAX_HEADER_BYTES:
            self._head_refused = True
            raise _HeadTooLarge  # stops the parser; uvicorn's bad-request answer becomes the 431

    def send_400_response(self, msg: str) -> None:
        if self._head_refused:
            self._refuse(_head_too_large())
        else:
            super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_parsed = True, 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes, self._head_done = False, 0, True
        self._disarm_head_timer()
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.transport is self.transport:
            self.cycle.transport = _LingeringClose(self.transport, self)

    def linger(self) -> None:
        """The response is out while the request's body still comes: FIN, discard the rest, close later."""
        self._lingering = 0
        self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def on_response_complete(self) -> None:
        self._head_bytes = 0  # the next request's head is counted from its first read
        super().on_response_complete()

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._head_too_slow)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self.transport.close()

    def _refuse(self, response: bytes) -> None:
        self._disarm_head_timer()
        self.transport.write(response)
        self.transport.close()


class _HeadTooLarge(Exception):
    """A request head past MAX_HEADER_BYTES (raised inside the parser's callbacks)."""


def _head_too_large() -> bytes:
    return error_bytes(431, f"the request line and headers exceed {MAX_HEADER_BYTES} bytes",
                       "invalid_request_error", "headers_too_large")


class _LingeringClose:
    """A request's view of the transport: closing it mid-body lingers (EdgeProtocol.linger)."""

    def __init__(self, transport, protocol: EdgeProtocol):
        self._transport, self._protocol = transport, protocol

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        t, cycle = self._transport, self._protocol.cycle
        if cycle is not None and cycle.more_body and not t.is_closing() and t.can_write_eof():
            self._protocol.linger()
        else:
            t.close()


class BodyLimit:
    """ASGI middleware: a request's body read whole, bounded in bytes and time, before the app runs."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES, timeout_s: float = BODY_TIMEOUT_S):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _answer(send, OpenAIError(400, "the Content-Length header is not a number"))
            if int(declared) > self.max_bytes:
                return await _answer(send, self._too_large())
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return  # the client went away: nobody to answer
                    chunk = msg.get("body", b"")
                    size += len(chunk)
                    if size > self.max_bytes:
                        return await _answer(send, self._too_large())
                    chunks.append(chunk)
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            return await _answer(send, OpenAIError(408, f"the request body did not arrive within {self.timeout_s:g} s",
                                                   code="request_timeout"))
        body, handed = b"".join(chunks), False

        async def receive_after():
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # from here on: the client's disconnect

        await self.app(scope, receive_after, send)

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"the request body exceeds {self.max_bytes} bytes", code="request_too_large")


async def _answer(send, err: OpenAIError) -> None:
    """`err` as the response, the connection closed after it (any unread body stays unread)."""
    body = err.body().model_dump_json().encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
