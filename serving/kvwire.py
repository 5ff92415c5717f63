"""KV on the wire: a canonical `KVRun` cut into `KVChunk` messages of about `chunk_bytes`
(sequence number, crc32, model fingerprint in the header), and the receiver's checks.

The crc32 covers every field a receiver acts on (request id, seq, start, token count, last,
known tokens, k, v), so a flipped bit anywhere but the header is DATA_LOSS; the header is
checked by value (a flipped fingerprint or dtype is refused, flipped sizes or positions do not
match the chunks). Nothing is imported before its chunk passed every check.

k and v travel as raw little-endian arrays [L, T, K, D] in the sender's dtype; the receiver
casts into its own pool dtype and page size (pddjax.kv.canonical.import_run).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from pddjax.kv.canonical import DTYPES, KVRun
from serving.pb import cluster_pb2


class WireError(Exception):
    """A stream that breaks the chunk protocol; `code_name` is the grpc.StatusCode name."""

    def __init__(self, code_name: str, message: str):
        super().__init__(message)
        self.code_name = code_name


def chunk_crc(c: cluster_pb2.KVChunk) -> int:
    """zlib.crc32 of (request id, seq, start, num_tokens, last, known tokens) then k then v."""
    meta = struct.pack(f"<IIII?{len(c.known_tokens)}I", c.seq, c.start, c.num_tokens, len(c.known_tokens), c.last,
                       *c.known_tokens) + c.request_id.encode()
    return zlib.crc32(c.v, zlib.crc32(c.k, zlib.crc32(meta)))


class Chunker:
    """Sender side for one target: tokens [start, end) of a sequence arrive as KVRun pieces
    (in order, possibly overlapping what was already sent); each becomes chunks of about
    `chunk_bytes`. The chunk that reaches `end` is the last and carries `known_tokens`."""

    def __init__(self, request_id: str, start: int, end: int, chunk_bytes: int):
        self.request_id, self.start, self.end, self.chunk_bytes = request_id, start, end, chunk_bytes
        self.next_pos, self.seq, self.bytes = start, 0, 0

    def feed(self, run: KVRun, known_tokens: list[int] | None = None) -> list[cluster_pb2.KVChunk]:
        L, _, K, D = run.k.shape
        step = max(1, self.chunk_bytes // (2 * L * K * D * run.k.dtype.itemsize))
        out = []
        a = max(self.next_pos, run.start)
        if a > self.next_pos:
            raise ValueError(f"KV piece starts at {run.start}, past the next token to send {self.next_pos}")
        while a < run.end:
            b = min(a + step, run.end)
            k = np.ascontiguousarray(run.k[:, a - run.start:b - run.start]).tobytes()
            v = np.ascontiguousarray(run.v[:, a - run.start:b - run.start]).tobytes()
            c = cluster_pb2.KVChunk(request_id=self.request_id, seq=self.seq, start=a, num_tokens=b - a, k=k, v=v,
                                    last=b == self.end)
            if self.seq == 0:
                c.header.CopyFrom(cluster_pb2.KVHeader(fingerprint=run.fingerprint, dtype=run.dtype, num_layers=L,
                                                       num_kv_heads=K, head_dim=D, start=self.start, end=self.end))
            if c.last:
                c.known_tokens.extend(known_tokens or [])
            c.crc32 = chunk_crc(c)
            out.append(c)
            self.seq, self.next_pos, self.bytes = self.seq + 1, b, self.bytes + len(k) + len(v)
            a = b
            if c.last:
                break
        return out


def chunks(request_id: str, run: KVRun, start: int, known_tokens: list[int],
           chunk_bytes: int) -> list[cluster_pb2.KVChunk]:
    """All chunks of tokens [start, run.end) of `run` (start >= run.start), in one go."""
    return Chunker(request_id, start, run.end, chunk_bytes).feed(run, known_tokens)


class Assembler:
    """Receiver side: checks order, checksum and layout of each chunk -> KVRun pieces."""

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint
        self.header: cluster_pb2.KVHeader | None = None
        self.next_seq, self.next_pos, self.bytes = 0, 0, 0

    def feed(self, c: cluster_pb2.KVChunk) -> KVRun | None:
        if chunk_crc(c) != c.crc32:
            raise WireError("DATA_LOSS", f"KV chunk {c.seq} of {c.request_id!r} fails its checksum")
        if c.seq != self.next_seq:
            raise WireError("DATA_LOSS", f"KV chunk {c.seq} arrived where chunk {self.next_seq} was expected")
        if c.seq == 0:
            if not c.HasField("header"):
                raise WireError("INVALID_ARGUMENT", "the first KV chunk carries no header")
            h = c.header
            if h.fingerprint != self.fingerprint:
                raise WireError("FAILED_PRECONDITION",
                                f"KV was computed by model {h.fingerprint}, this service serves {self.fingerprint}")
            if h.dtype not in DTYPES:
                raise WireError("FAILED_PRECONDITION", f"KV dtype {h.dtype!r} is not one of {sorted(DTYPES)}")
            self.header, self.next_pos = h, h.start
        h = self.header
        if c.start != self.next_pos or c.start + c.num_tokens > h.end:
            raise WireError("DATA_LOSS", f"KV chunk {c.seq} covers tokens from {c.start}, expected {self.next_pos}")
        dt = np.dtype(DTYPES[h.dtype])
        shape = (h.num_layers, c.num_tokens, h.num_kv_heads, h.head_dim)
        if len(c.k) != int(np.prod(shape)) * dt.itemsize or len(c.v) != len(c.k):
            raise WireError("INVALID_ARGUMENT", f"KV chunk {c.seq} has {len(c.k)} bytes, not a {shape} {h.dtype} array")
        self.next_seq += 1
        self.next_pos += c.num_tokens
        self.bytes += len(c.k) + len(c.v)
        if c.last and self.next_pos != h.end:
            raise WireError("DATA_LOSS", f"KV stream ended at token {self.next_pos}, expected {h.end}")
        if not c.num_tokens:
            return None
        k = np.frombuffer(c.k, dt).reshape(shape)
        v = np.frombuffer(c.v, dt).reshape(shape)
        return KVRun(h.fingerprint, c.start, k, v, h.dtype)
