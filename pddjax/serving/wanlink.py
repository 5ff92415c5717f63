"""A slowable A -> B link: an asyncio TCP proxy with a bandwidth cap and one-way latency per
direction, counting bytes. `pddjax up` puts it between cluster A (P, RLD) and MD.

Each direction is a FIFO "wire": a read of n bytes finishes transmitting at
max(now, wire free) + n * 8 / bandwidth and arrives `latency` later, in order.
Settings can change while running (tests slow the link between requests).
"""

from __future__ import annotations

import asyncio
import time


class WanLink:
    def __init__(self, target_host: str, target_port: int, mbps: float = 0.0, latency_ms: float = 0.0):
        self.target = (target_host, target_port)
        self.mbps, self.latency_ms = mbps, latency_ms
        self.bytes_a_to_b = 0  # client -> target (the KV and handoff direction)
        self.bytes_b_to_a = 0
        self.connections = 0
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._server = await asyncio.start_server(self._handle, host, port)
        h, p = self._server.sockets[0].getsockname()[:2]
        return f"{h}:{p}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()

    def stats(self) -> dict:
        return {"mbps": self.mbps, "latency_ms": self.latency_ms, "bytes_a_to_b": self.bytes_a_to_b,
                "bytes_b_to_a": self.bytes_b_to_a, "connections": self.connections}

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            tr, tw = await asyncio.open_connection(*self.target)
        except OSError:
            cw.close()
            return
        self.connections += 1
        for coro in (self._pipe(cr, tw, True), self._pipe(tr, cw, False)):
            t = asyncio.create_task(coro)
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pipe(self, reader, writer, a_to_b: bool) -> None:
        q: asyncio.Queue = asyncio.Queue()
        free_at = 0.0

        async def deliver():
            while True:
                at, data = await q.get()
                if data is None:
                    break
                delay = at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while True:
                data = await reader.read(64 * 1024)
                if not data:
                    break
                if a_to_b:
                    self.bytes_a_to_b += len(data)
                else:
                    self.bytes_b_to_a += len(data)
                now = time.monotonic()
                tx = len(data) * 8 / (self.mbps * 1e6) if self.mbps > 0 else 0.0
                free_at = max(now, free_at) + tx
                q.put_nowait((free_at + self.latency_ms / 1e3, data))
            q.put_nowait((0.0, None))
            await sender
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            sender.cancel()
            try:
                writer.close()
            except Exception:  # noqa: BLE001
                pass
