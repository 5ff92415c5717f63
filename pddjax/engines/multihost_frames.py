"""The frames of a multi-host instance's op channel (engines/multihost.py): one op is a JSON
header (op, statics, each array's dtype and shape) behind its 4-byte length, then each
array's raw bytes. A channel's end of file before a stop means the leader is gone."""

from __future__ import annotations

import json
import socket
import struct

import jax.numpy as jnp
import numpy as np

_HEADER = struct.Struct("!I")  # JSON header length


class LeaderGone(RuntimeError):
    """The leader's channel closed (or failed) before a stop."""


def send(sock: socket.socket, op: str, meta: dict, arrays: list[np.ndarray]) -> None:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    header = json.dumps({"op": op, "meta": meta,
                         "arrays": [[a.dtype.name, list(a.shape)] for a in arrays]}).encode()
    sock.sendall(_HEADER.pack(len(header)) + header)
    for a in arrays:
        if a.nbytes:
            sock.sendall(memoryview(a.reshape(-1).view(np.uint8)))


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf, got = bytearray(n), 0
    view = memoryview(buf)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise LeaderGone("the leader closed the channel")
        got += k
    return buf


def recv(sock: socket.socket, limit: int | None = None) -> tuple[str, dict, list[np.ndarray]]:
    """One frame; `limit`: the most bytes it may hold (a hello from an unknown peer), else ValueError."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if limit is not None and size > limit:
        raise ValueError(f"a frame header of {size} bytes is over {limit}")
    header = json.loads(_recv_exact(sock, size))
    if limit is not None and header["arrays"]:
        raise ValueError("this frame may carry no arrays")
    arrays = []
    for dtype, shape in header["arrays"]:
        dt = jnp.dtype(dtype)  # numpy's, or ml_dtypes' bfloat16
        n = int(np.prod(shape)) * dt.itemsize
        arrays.append(np.frombuffer(_recv_exact(sock, n), dt).reshape(shape) if n else np.zeros(shape, dt))
    return header["op"], header["meta"], arrays
