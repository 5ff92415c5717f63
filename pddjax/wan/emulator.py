"""The WAN link emulator: an asyncio TCP proxy from cluster A to a service in cluster B.

Every byte A -> B and B -> A is scheduled on that direction's shared `Wire` (bandwidth trace,
token bucket, stalls, latency + jitter, in order) and counted. Faults for reliability tests can
be injected at any time, per direction:
  reset          abort every open connection now (RST) and refuse new ones while set
  blackhole      bytes that enter the link while set are held (nothing after them is delivered
                 either), connections stay open; once cleared, what was held is delivered, as TCP
                 would retransmit it
  flip           flip one bit in the next chunk that passes (then clear itself)
  flip_at=N      flip one bit of the N-th byte (from 0) that a connection sends in that direction
                 from now on (the first to get there; then clear itself): aims past the headers
  close_after=N  forward only N more bytes per connection in that direction, then close it (FIN)
A connection that breaks on one side (the service died: RST) is aborted on the other too, as a
peer across a real WAN would see it. Call `inject` on the emulator's event loop (tests:
`loop.call_soon_threadsafe`): a reset touches sockets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import struct
import time

from pddjax.wan.shaping import LinkProfile, Wire

A_TO_B, B_TO_A = "a_to_b", "b_to_a"


@dataclasses.dataclass
class Fault:
    reset: bool = False
    blackhole: bool = False
    flip: bool = False
    flip_at: int | None = None
    close_after: int | None = None


class WanEmulator:
    def __init__(self, target: str, profile: LinkProfile | None = None, reverse: LinkProfile | None = None):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.profile = profile or LinkProfile()
        t0 = time.monotonic()
        self.wires = {A_TO_B: Wire(self.profile, t0), B_TO_A: Wire(reverse or self.profile, t0)}
        self.faults = {A_TO_B: Fault(), B_TO_A: Fault()}
        self.connections = 0
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task] = set()

    # ---- control ---------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._server = await asyncio.start_server(self._handle, host, port)
        h, p = self._server.sockets[0].getsockname()[:2]
        return f"{h}:{p}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for cw, tw in list(self._conns):
            _abort(cw)
            _abort(tw)
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # let each connection's handler see its pipes end

    def set_profile(self, profile: LinkProfile, direction: str | None = None) -> None:
        """New shaping for one or both directions (byte counts are kept)."""
        for d in ([direction] if direction else [A_TO_B, B_TO_A]):
            old = self.wires[d]
            w = Wire(profile, old.t0)
            w.bytes, w.free_at, w.last_delivery = old.bytes, old.free_at, old.last_delivery
            self.wires[d] = w
        self.profile = profile

    def inject(self, direction: str = A_TO_B, **fault) -> None:
        """inject(A_TO_B, blackhole=True) / (reset=True) / (flip=True) / (flip_at=2000) / (close_after=1000)."""
        f = dataclasses.replace(self.faults[direction], **fault)
        self.faults[direction] = f
        if f.reset:
            for cw, tw in list(self._conns):
                _abort(cw)
                _abort(tw)

    def clear_faults(self) -> None:
        self.faults = {A_TO_B: Fault(), B_TO_A: Fault()}

    def stats(self) -> dict:
        return {"bytes_a_to_b": self.wires[A_TO_B].bytes, "bytes_b_to_a": self.wires[B_TO_A].bytes,
                "connections": self.connections, "mbps": self.profile.mbps,
                "latency_ms": self.profile.latency_ms, "jitter_ms": self.profile.jitter_ms}

    # ---- data path -------------------------------------------------------------------
    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        if self.faults[A_TO_B].reset or self.faults[B_TO_A].reset:
            _abort(cw)
            return
        try:
            tr, tw = await asyncio.open_connection(*self.target)
        except OSError:
            _abort(cw)
            return
        self.connections += 1
        pair = (cw, tw)
        self._conns.add(pair)
        tasks = [asyncio.create_task(self._pipe(cr, tw, A_TO_B, pair)),
                 asyncio.create_task(self._pipe(tr, cw, B_TO_A, pair))]
        for t in tasks:
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:
            pass  # end normally: Python 3.11's stream callback chokes on a cancelled handler task
        finally:  # both directions done (each half-closed its far side): close the sockets
            self._conns.discard(pair)
            for w in pair:
                w.close()

    async def _pipe(self, reader, writer, direction: str, pair) -> None:
        q: asyncio.Queue = asyncio.Queue()
        passed, fault_seen, base = 0, None, 0  # bytes forwarded; close_after counts from its injection

        async def deliver():
            try:
                while True:
                    at, data, held = await q.get()
                    if data is None:
                        break
                    while held and self.faults[direction].blackhole:  # held, not lost: delivered once it clears
                        await asyncio.sleep(0.02)
                        at = max(at, time.monotonic())
                    delay = at - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    writer.write(data)
                    await writer.drain()
            except ConnectionError:  # the far side is gone: so is this connection
                for w in pair:
                    _abort(w)

        sender = asyncio.create_task(deliver())
        try:
            while True:
                data = await reader.read(64 * 1024)
                if not data:
                    break
                f = self.faults[direction]
                if f is not fault_seen:
                    fault_seen, base = f, passed
                if f.flip:
                    data = data[:-1] + bytes([data[-1] ^ 0x01])
                    self.faults[direction] = fault_seen = dataclasses.replace(f, flip=False)
                at = None if f.flip_at is None else f.flip_at - (passed - base)
                if at is not None and 0 <= at < len(data) and self.faults[direction].flip_at is not None:
                    data = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]
                    self.faults[direction] = fault_seen = dataclasses.replace(self.faults[direction], flip_at=None)
                if f.close_after is not None and passed - base + len(data) >= f.close_after:
                    data = data[: max(0, f.close_after - (passed - base))]
                    q.put_nowait((self.wires[direction].schedule(time.monotonic(), len(data)), data, f.blackhole))
                    break  # stop forwarding: FIN after the first N bytes (the peer sees a clean close)
                passed += len(data)
                q.put_nowait((self.wires[direction].schedule(time.monotonic(), len(data)), data, f.blackhole))
            q.put_nowait((0.0, None, False))
            await sender
            if writer.can_write_eof():
                writer.write_eof()  # half-close: the other direction keeps flowing
        except ConnectionError:  # one side was reset (or died): the other side sees a reset too
            for w in pair:
                _abort(w)
        except asyncio.CancelledError:
            pass
        finally:
            sender.cancel()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0) so the peer sees a reset, not a clean end of stream."""
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    except Exception:  # noqa: BLE001, S110  (already closed)
        pass
