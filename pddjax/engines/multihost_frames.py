"""The frames of a multi-host instance's op channel (engines/multihost.py): one op is a JSON
header (op, statics, each array's dtype and shape) behind its 4-byte length, then each
array's raw bytes. A channel's end of file before a stop means the leader is gone.

Both ends bound a frame before it moves: `send` refuses a frame over `limit` bytes before
writing any of it (the channel stays in step), `recv` checks the header's length, its form,
every dtype against a fixed list and the frame's total size against `limit` before it
allocates a byte for the arrays (a huge length prefix is a FrameError, not a huge buffer).
`deadline` (a `time.monotonic()` value) bounds a whole `recv`, however slowly its bytes come.
`send` writes in CHUNK pieces, so a socket timeout bounds each piece: a peer that takes no
CHUNK in that long fails the write with TimeoutError.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import time

import jax.numpy as jnp
import numpy as np

_LENGTH = struct.Struct("!I")  # JSON header length
MAX_HEADER = 16 << 20  # a header's JSON at most (an import's page list of a million pages fits)
CHUNK = 1 << 20  # bytes per write: small frames go out in one, a KV run in pieces
DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                    "float16", "float32", "float64", "bfloat16"})  # what steps and KV runs carry


class LeaderGone(RuntimeError):
    """The leader's channel closed (or failed) before a stop."""


class FrameError(ValueError):
    """A frame that is malformed or larger than this channel allows (one sentence)."""


def _header(op: str, meta: dict, arrays: list[np.ndarray]) -> bytes:
    return json.dumps({"op": op, "meta": meta, "arrays": [[a.dtype.name, list(a.shape)] for a in arrays]}).encode()


def _pieces(parts: list[memoryview]):
    """`parts` as writes of CHUNK bytes at most; small parts joined into one write."""
    buf = bytearray()
    for part in parts:
        while len(part):
            if not buf and len(part) >= CHUNK:
                yield part[:CHUNK]
                part = part[CHUNK:]
                continue
            take = part[:CHUNK - len(buf)]
            buf += take
            part = part[len(take):]
            if len(buf) == CHUNK:
                yield bytes(buf)
                buf.clear()
    if buf:
        yield bytes(buf)


def send(sock: socket.socket, op: str, meta: dict, arrays: list[np.ndarray], limit: int | None = None) -> None:
    """One frame; `limit`: the most bytes it may hold, else FrameError before anything is written."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    header = _header(op, meta, arrays)
    size = _LENGTH.size + len(header) + sum(a.nbytes for a in arrays)
    if len(header) > MAX_HEADER or (limit is not None and size > limit):
        raise FrameError(f"a {op} frame of {size} bytes is over this channel's limit of {limit} bytes")
    parts = [memoryview(_LENGTH.pack(len(header)) + header)]
    parts += [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays if a.nbytes]
    for piece in _pieces(parts):
        sock.sendall(piece)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytearray:
    buf, got = bytearray(n), 0
    view = memoryview(buf)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the peer did not send a whole frame in time")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise LeaderGone("the leader closed the channel")
        got += k
    return buf


def _layout(header) -> tuple[str, dict, list[tuple[np.dtype, tuple[int, ...], int]]]:
    """(op, meta, [(dtype, shape, nbytes)]) of a parsed header, or FrameError."""
    if not (isinstance(header, dict) and isinstance(header.get("op"), str) and isinstance(header.get("meta"), dict)
            and isinstance(header.get("arrays"), list)):
        raise FrameError("a frame header must be an object with op, meta and arrays")
    specs = []
    for spec in header["arrays"]:
        if not (isinstance(spec, list) and len(spec) == 2 and spec[0] in DTYPES and isinstance(spec[1], list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in spec[1])):
            raise FrameError(f"a frame's array must be [dtype, shape] with a known dtype, got {str(spec)[:80]}")
        dt = jnp.dtype(spec[0])  # numpy's, or ml_dtypes' bfloat16
        specs.append((dt, tuple(spec[1]), math.prod(spec[1]) * dt.itemsize))
    return header["op"], header["meta"], specs


def recv(sock: socket.socket, limit: int | None = None, deadline: float | None = None,
         arrays_allowed: bool = True) -> tuple[str, dict, list[np.ndarray]]:
    """One frame of at most `limit` bytes (header included), all of it by `deadline`; FrameError
    for one over the limit or malformed, checked before its arrays are allocated."""
    (size,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, deadline))
    cap = MAX_HEADER if limit is None else min(MAX_HEADER, limit - _LENGTH.size)
    if size > cap:
        raise FrameError(f"a frame header of {size} bytes is over this channel's limit of {cap}")
    try:
        header = json.loads(_recv_exact(sock, size, deadline))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise FrameError("a frame header is not JSON") from None
    op, meta, specs = _layout(header)
    if specs and not arrays_allowed:
        raise FrameError(f"a {op} frame may carry no arrays")
    total = _LENGTH.size + size + sum(n for _, _, n in specs)
    if limit is not None and total > limit:
        raise FrameError(f"a {op} frame of {total} bytes is over this channel's limit of {limit} bytes")
    arrays = [np.frombuffer(_recv_exact(sock, n, deadline), dt).reshape(shape) if n else np.zeros(shape, dt)
              for dt, shape, n in specs]
    return op, meta, arrays


def frame_limit(engine) -> int:
    """The largest op frame `engine` can need: an import of its whole pool's KV in float32, or a
    step (page tables of every row over every page), plus 1 MiB; both ends refuse a larger one."""
    c, e = engine.cfg, engine.config
    kv = 2 * c.num_layers * e.num_pages * e.page_size * c.num_kv_heads * c.head_dim * 4
    return kv + 4 * e.max_rows * e.num_pages + 64 * e.max_step_tokens + (1 << 20)
