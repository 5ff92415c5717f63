"""KV on the wire: a canonical `KVRun` cut into `KVChunk` messages of about `chunk_bytes`
(sequence number, crc32, model fingerprint and wire format in the header), and the receiver's checks.

The crc32 covers every field a receiver acts on (request id, seq, start, token count, last,
known tokens, k, v, scales, and the header's wire format), over the bytes as encoded, so a
flipped bit anywhere but the rest of the header is DATA_LOSS; the header is checked by value (a
flipped fingerprint or dtype is refused, flipped sizes or positions do not match the chunks).
Nothing is imported before its chunk passed every check.

k and v travel [L, T, K, D] in the wire format the router chose for the link (the header's
`kv_wire`, pddjax.kv.codec): `native` = raw little-endian in the sender's dtype, else bf16,
int8 / fp8 with per-page scales (the chunk's `scales`), optionally zstd on top. The sender
encodes per chunk; the receiver refuses a format it did not declare (INVALID_ARGUMENT), decodes
into its own pool dtype, and import_run writes that at its page size.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from pddjax.kv import codec
from pddjax.kv.canonical import DTYPES, KVRun
from serving.pb import cluster_pb2

ACCEPTED = codec.FORMATS  # what a receiver of this build declares (ServiceInfo.kv_wire_formats)


class WireError(Exception):
    """A stream that breaks the chunk protocol; `code_name` is the grpc.StatusCode name."""

    def __init__(self, code_name: str, message: str):
        super().__init__(message)
        self.code_name = code_name


def chunk_crc(c: cluster_pb2.KVChunk) -> int:
    """zlib.crc32 of (request id, seq, start, num_tokens, last, known tokens[, the header's
    kv_wire and page_tokens]) then k, v and scales as encoded."""
    meta = struct.pack(f"<IIII?{len(c.known_tokens)}I", c.seq, c.start, c.num_tokens, len(c.known_tokens), c.last,
                       *c.known_tokens) + c.request_id.encode()
    if c.HasField("header"):
        meta += struct.pack("<I", c.header.page_tokens) + c.header.kv_wire.encode()
    return zlib.crc32(c.scales, zlib.crc32(c.v, zlib.crc32(c.k, zlib.crc32(meta))))


class Chunker:
    """Sender side for one target: tokens [start, end) of a sequence arrive as KVRun pieces
    (in order, possibly overlapping what was already sent); each becomes chunks of about
    `chunk_bytes` (encoded, before zstd) in the wire format `kv_wire`, scales per page of
    `page_tokens` (int8 / fp8 chunks end at page boundaries: at least one page, or the rest of
    the piece, even past `chunk_bytes`). The chunk
    that reaches `end` is the last and carries `known_tokens`. `bytes` counts what was sent
    (encoded), `native_bytes` what the same tokens weigh in the canonical form."""

    def __init__(self, request_id: str, start: int, end: int, chunk_bytes: int, kv_wire: str = "native",
                 page_tokens: int = 16):
        self.request_id, self.start, self.end, self.chunk_bytes = request_id, start, end, chunk_bytes
        self.format, self.page_tokens = codec.parse(kv_wire), page_tokens
        self.next_pos, self.seq, self.bytes, self.native_bytes = start, 0, 0, 0

    def feed(self, run: KVRun, known_tokens: list[int] | None = None) -> list[cluster_pb2.KVChunk]:
        L, _, K, D = run.k.shape
        S, fmt = self.page_tokens, self.format
        step = max(1, int(self.chunk_bytes // codec.bytes_per_token(fmt.name, L, K, D, run.dtype, S)))
        out = []
        a = max(self.next_pos, run.start)
        if a > self.next_pos:
            raise ValueError(f"KV piece starts at {run.start}, past the next token to send {self.next_pos}")
        while a < run.end:
            b = min(a + step, run.end)
            if fmt.scaled and b < run.end:  # one scale per page: no page split between two chunks
                b = b // S * S if b // S * S > a else min(run.end, (a // S + 1) * S)
            enc = codec.encode(run.k[:, a - run.start:b - run.start], run.v[:, a - run.start:b - run.start], a,
                               fmt.name, S)
            c = cluster_pb2.KVChunk(request_id=self.request_id, seq=self.seq, start=a, num_tokens=b - a, k=enc.k,
                                    v=enc.v, scales=enc.scales, last=b == self.end)
            if self.seq == 0:
                c.header.CopyFrom(cluster_pb2.KVHeader(fingerprint=run.fingerprint, dtype=run.dtype, num_layers=L,
                                                       num_kv_heads=K, head_dim=D, start=self.start, end=self.end,
                                                       kv_wire=fmt.name, page_tokens=S if fmt.scaled else 0))
            if c.last:
                c.known_tokens.extend(known_tokens or [])
            c.crc32 = chunk_crc(c)
            out.append(c)
            self.seq, self.next_pos, self.bytes = self.seq + 1, b, self.bytes + enc.nbytes
            self.native_bytes += 2 * L * (b - a) * K * D * run.k.dtype.itemsize
            a = b
            if c.last:
                break
        return out


def chunks(request_id: str, run: KVRun, start: int, known_tokens: list[int], chunk_bytes: int,
           kv_wire: str = "native", page_tokens: int = 16) -> list[cluster_pb2.KVChunk]:
    """All chunks of tokens [start, run.end) of `run` (start >= run.start), in one go."""
    return Chunker(request_id, start, run.end, chunk_bytes, kv_wire, page_tokens).feed(run, known_tokens)


class Assembler:
    """Receiver side: checks order, checksum, wire format and layout of each chunk -> KVRun
    pieces; native ones stay in the sender's dtype (import_run casts, as before), the others are
    decoded into `out_dtype` (the receiver's pool dtype; None: float32). `accepts`: the formats
    this receiver declared."""

    def __init__(self, fingerprint: str, accepts: tuple[str, ...] = ACCEPTED, out_dtype: str | None = None):
        self.fingerprint, self.accepts, self.out_dtype = fingerprint, tuple(accepts), out_dtype
        self.header: cluster_pb2.KVHeader | None = None
        self.format: codec.Format | None = None
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
            name = h.kv_wire or "native"
            if name not in self.accepts:
                raise WireError("INVALID_ARGUMENT", f"KV wire format {name!r} is not one this receiver declared "
                                                    f"({', '.join(self.accepts)})")
            try:
                self.format = codec.parse(name)
            except codec.CodecError as e:
                raise WireError("INVALID_ARGUMENT", str(e)) from None
            if self.format.scaled and not h.page_tokens:
                raise WireError("INVALID_ARGUMENT", f"a {name} KV stream names no page size for its scales")
            self.header, self.next_pos = h, h.start
        h = self.header
        if c.start != self.next_pos or c.start + c.num_tokens > h.end:
            raise WireError("DATA_LOSS", f"KV chunk {c.seq} covers tokens from {c.start}, expected {self.next_pos}")
        shape = (h.num_layers, c.num_tokens, h.num_kv_heads, h.head_dim)
        try:
            k, v = codec.decode(codec.Encoded(c.k, c.v, c.scales), self.format.name, h.dtype, shape, c.start,
                                h.page_tokens or 1, None if self.format.base == "native" else self.out_dtype)
        except codec.CodecError as e:
            raise WireError("INVALID_ARGUMENT", f"KV chunk {c.seq}: {e}") from None
        self.next_seq += 1
        self.next_pos += c.num_tokens
        self.bytes += len(c.k) + len(c.v) + len(c.scales)
        if c.last and self.next_pos != h.end:
            raise WireError("DATA_LOSS", f"KV stream ended at token {self.next_pos}, expected {h.end}")
        if not c.num_tokens:
            return None
        return KVRun(h.fingerprint, c.start, k, v, np.dtype(k.dtype).name)
