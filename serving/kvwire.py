"""KV on the wire: a canonical `KVRun` cut into `KVChunk` messages of about `chunk_bytes`
(sequence number, crc32, model fingerprint and wire format in the header), and the receiver's checks.

The crc32 covers every field a receiver acts on (request id, seq, start, token count, last,
known tokens, head range, k, v, scales, and the header's wire format and head split), over the
bytes as encoded, so a flipped bit anywhere but the rest of the header is DATA_LOSS; the header
is checked by value (a flipped fingerprint or dtype is refused, flipped sizes or positions do
not match the chunks). Nothing is imported before its chunk passed every check. A service's
receiver names its own model's layout and the tokens the reservation holds (`Assembler`'s
`layout`, `max_end`): a header that disagrees is INVALID_ARGUMENT before any chunk is decoded,
so no chunk decodes to more than the reservation's bytes; every chunk of a stream names the
request its first chunk named (else INVALID_ARGUMENT).

k and v travel [L, T, Kr, D] in the wire format the router chose for the link (the header's
`kv_wire`, pddjax.kv.codec): `native` = raw little-endian in the sender's dtype, else bf16,
int8 / fp8 with per-page, per-head scales (the chunk's `scales`), optionally zstd on top. The
sender encodes per chunk; the receiver refuses a format it did not declare (INVALID_ARGUMENT),
decodes into its own pool dtype, and import_run writes that at its page size.

Tensor parallelism: a sender whose pool is split over KV heads sends each shard's heads as its
own chunks (`head_start`, `head_end`; every range of one token block, then the next block); the
header names its degree (`tensor_parallel`) and its split (`head_bounds`: ranges
[b_i, b_i+1)); a replicated pool sends each head once (one range). The receiver holds a block's
pieces until every range arrived, then hands them on together (import_run places each head on
the devices that hold it); a range outside the split, a head twice or a block left with heads
missing is DATA_LOSS (`Assembler.check_integrity`). A stream without a split is today's: one
chunk per block, all heads, no head fields (the TP=1 path is byte-for-byte unchanged).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from pddjax.kv import codec
from pddjax.kv.canonical import DTYPES, KVRun, Pieces, as_pieces, head_problem
from serving.pb import cluster_pb2

ACCEPTED = codec.FORMATS  # what a receiver of this build declares (ServiceInfo.kv_wire_formats)


class WireError(Exception):
    """A stream that breaks the chunk protocol; `code_name` is the grpc.StatusCode name."""

    def __init__(self, code_name: str, message: str):
        super().__init__(message)
        self.code_name = code_name


def chunk_crc(c: cluster_pb2.KVChunk) -> int:
    """zlib.crc32 of (request id, seq, start, num_tokens, last, known tokens[, head range][, the
    header's kv_wire, page_tokens[, tensor_parallel and head_bounds]][, the known tokens' logprobs
    serialized]) then k, v and scales as encoded."""
    meta = struct.pack(f"<IIII?{len(c.known_tokens)}I", c.seq, c.start, c.num_tokens, len(c.known_tokens), c.last,
                       *c.known_tokens) + c.request_id.encode()
    if c.head_end:  # a piece of the heads (a tensor-parallel sender); absent = all heads, as before
        meta += struct.pack("<II", c.head_start, c.head_end)
    if c.HasField("header"):
        meta += struct.pack("<I", c.header.page_tokens) + c.header.kv_wire.encode()
        if c.header.head_bounds:
            meta += struct.pack(f"<I{len(c.header.head_bounds)}I", c.header.tensor_parallel, *c.header.head_bounds)
    for lp in c.known_logprobs:  # absent unless the request asked for logprobs
        meta += lp.SerializeToString(deterministic=True)
    return zlib.crc32(c.scales, zlib.crc32(c.v, zlib.crc32(c.k, zlib.crc32(meta))))


class Chunker:
    """Sender side for one target: tokens [start, end) of a sequence arrive as KVRun pieces
    (in order, possibly overlapping what was already sent), each whole or as the head pieces of
    a sharded pool (`export_shards`); each token block becomes chunks of about `chunk_bytes`
    (encoded, before zstd; one per head piece) in the wire format `kv_wire`, scales per page of
    `page_tokens` (int8 / fp8 chunks end at page boundaries: at least one page, or the rest of
    the piece, even past `chunk_bytes`). `tensor_parallel`: the sender's degree (the header
    names it and the head split when > 1 or when the pieces split the heads). The chunk that
    reaches `end` is the last and carries `known_tokens`. `bytes` counts what was sent (encoded),
    `native_bytes` what the same tokens weigh in the canonical form."""

    def __init__(self, request_id: str, start: int, end: int, chunk_bytes: int, kv_wire: str = "native",
                 page_tokens: int = 16, tensor_parallel: int = 1):
        self.request_id, self.start, self.end, self.chunk_bytes = request_id, start, end, chunk_bytes
        self.format, self.page_tokens, self.tensor_parallel = codec.parse(kv_wire), page_tokens, tensor_parallel
        self.next_pos, self.seq, self.bytes, self.native_bytes = start, 0, 0, 0
        self.bounds: list[int] | None = None  # the head split, fixed by the first piece

    def _split(self, pieces: list[KVRun]) -> list[int]:
        bounds = [pieces[0].head_start] + [r.head_end for r in pieces]
        problem = head_problem(pieces, bounds[-1])
        if problem:
            raise ValueError(problem)
        if self.bounds is None:
            self.bounds = bounds
        elif bounds != self.bounds:
            raise ValueError(f"KV head split {bounds} differs from the stream's {self.bounds}")
        return bounds

    def feed(self, run: Pieces, known_tokens: list[int] | None = None,
             known_logprobs: list | None = None) -> list[cluster_pb2.KVChunk]:
        """Chunks of the tokens of `run` not sent yet; the last carries `known_tokens` and their
        logprobs (common_pb2.TokenLogprob, one per known token, or none)."""
        pieces = as_pieces(run)
        bounds = self._split(pieces)
        split = self.tensor_parallel > 1 or len(pieces) > 1  # head fields on the wire
        first = pieces[0]
        L, _, _, D = first.k.shape
        S, fmt = self.page_tokens, self.format
        widest = max(r.k.shape[2] for r in pieces)
        step = max(1, int(self.chunk_bytes // codec.bytes_per_token(fmt.name, L, widest, D, first.dtype, S)))
        out = []
        a = max(self.next_pos, first.start)
        if a > self.next_pos:
            raise ValueError(f"KV piece starts at {first.start}, past the next token to send {self.next_pos}")
        while a < first.end:
            b = min(a + step, first.end)
            if fmt.scaled and b < first.end:  # one scale per page: no page split between two chunks
                b = b // S * S if b // S * S > a else min(first.end, (a // S + 1) * S)
            for i, r in enumerate(pieces):
                c = self._chunk(r, a, b, known_tokens, last=b == self.end and i == len(pieces) - 1)
                if c.last and known_logprobs:
                    c.known_logprobs.extend(known_logprobs)
                if split:
                    c.head_start, c.head_end = r.head_start, r.head_end
                if self.seq == 0:
                    c.header.CopyFrom(cluster_pb2.KVHeader(
                        fingerprint=r.fingerprint, dtype=r.dtype, num_layers=L, num_kv_heads=bounds[-1], head_dim=D,
                        start=self.start, end=self.end, kv_wire=fmt.name, page_tokens=S if fmt.scaled else 0))
                    if split:
                        c.header.tensor_parallel = self.tensor_parallel
                        c.header.head_bounds.extend(bounds)
                c.crc32 = chunk_crc(c)
                out.append(c)
                self.seq += 1
            self.next_pos = b
            a = b
            if b == self.end:
                break
        return out

    def _chunk(self, r: KVRun, a: int, b: int, known_tokens, last: bool) -> cluster_pb2.KVChunk:
        """Tokens [a, b) of piece `r`, encoded (no header, head range or crc yet)."""
        enc = codec.encode(r.k[:, a - r.start:b - r.start], r.v[:, a - r.start:b - r.start], a, self.format.name,
                           self.page_tokens)
        c = cluster_pb2.KVChunk(request_id=self.request_id, seq=self.seq, start=a, num_tokens=b - a, k=enc.k,
                                v=enc.v, scales=enc.scales, last=last)
        if last:
            c.known_tokens.extend(known_tokens or [])
        self.bytes += enc.nbytes
        self.native_bytes += 2 * r.k.shape[0] * (b - a) * r.k.shape[2] * r.k.shape[3] * r.k.dtype.itemsize
        return c


def chunks(request_id: str, run: Pieces, start: int, known_tokens: list[int], chunk_bytes: int,
           kv_wire: str = "native", page_tokens: int = 16, tensor_parallel: int = 1) -> list[cluster_pb2.KVChunk]:
    """All chunks of tokens [start, run.end) of `run` (start >= run.start), in one go."""
    end = as_pieces(run)[0].end
    return Chunker(request_id, start, end, chunk_bytes, kv_wire, page_tokens, tensor_parallel).feed(run, known_tokens)


class Assembler:
    """Receiver side: checks order, checksum, wire format, layout and head ranges of each chunk
    -> KVRun pieces (a whole run per token block, or that block's head pieces, by first head,
    once every range of the sender's split arrived); native ones stay in the sender's dtype
    (import_run casts, as before), the others are decoded into `out_dtype` (the receiver's pool
    dtype; None: float32). `accepts`: the formats this receiver declared. A service names its
    own model's `layout` (layers, KV heads, head_dim) and `max_end`, the tokens its reservation
    holds: a header that disagrees with either is refused before any chunk is decoded, so no
    chunk decodes to more than the reservation's bytes (None: unchecked, for local tools)."""

    def __init__(self, fingerprint: str, accepts: tuple[str, ...] = ACCEPTED, out_dtype: str | None = None,
                 layout: tuple[int, int, int] | None = None, max_end: int | None = None):
        self.fingerprint, self.accepts, self.out_dtype = fingerprint, tuple(accepts), out_dtype
        self.layout, self.max_end = layout, max_end
        self.request_id: str | None = None  # the stream's, named by its first chunk
        self.header: cluster_pb2.KVHeader | None = None
        self.format: codec.Format | None = None
        self.ranges: list[tuple[int, int]] = []  # the sender's head split
        self.block: list[KVRun] = []  # pieces of the token block being assembled
        self.next_seq, self.next_pos, self.bytes = 0, 0, 0

    def _open(self, c: cluster_pb2.KVChunk) -> None:
        if not c.HasField("header"):
            raise WireError("INVALID_ARGUMENT", "the first KV chunk carries no header")
        h = c.header
        if h.fingerprint != self.fingerprint:
            raise WireError("FAILED_PRECONDITION",
                            f"KV was computed by model {h.fingerprint}, this service serves {self.fingerprint}")
        if h.dtype not in DTYPES:
            raise WireError("FAILED_PRECONDITION", f"KV dtype {h.dtype!r} is not one of {sorted(DTYPES)}")
        said = (h.num_layers, h.num_kv_heads, h.head_dim)
        if self.layout is not None and said != tuple(self.layout):
            raise WireError("INVALID_ARGUMENT", "KV header says {} layers x {} KV heads x head_dim {}; this "
                                                "service's model has {} x {} x {}".format(*said, *self.layout))
        if h.start > h.end:
            raise WireError("INVALID_ARGUMENT", f"KV header names tokens [{h.start}, {h.end}), a range that ends "
                                                f"before it starts")
        if self.max_end is not None and h.end > self.max_end:
            raise WireError("INVALID_ARGUMENT", f"KV for tokens [{h.start}, {h.end}) of {c.request_id!r} does not "
                                                f"fit the {self.max_end} tokens reserved for it")
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
        bounds = list(h.head_bounds) or [0, h.num_kv_heads]
        if bounds[0] != 0 or bounds[-1] != h.num_kv_heads or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise WireError("INVALID_ARGUMENT", f"KV head split {bounds} does not cut the {h.num_kv_heads} KV heads "
                                                f"into ranges from 0")
        self.ranges = list(zip(bounds, bounds[1:]))
        self.header, self.next_pos, self.request_id = h, h.start, c.request_id

    def _heads(self, c: cluster_pb2.KVChunk) -> tuple[int, int]:
        heads = (c.head_start, c.head_end) if c.head_end else (0, self.header.num_kv_heads)
        if heads not in self.ranges:
            raise WireError("DATA_LOSS", f"KV chunk {c.seq} carries heads [{heads[0]}, {heads[1]}), not one of the "
                                         f"sender's ranges {_ranges(self.ranges)}")
        if any(r.head_start == heads[0] for r in self.block):
            b = self.block[0]
            raise WireError("DATA_LOSS", f"KV heads [{heads[0]}, {heads[1]}) of tokens [{b.start}, {b.end}) arrive "
                                         f"twice (chunk {c.seq})")
        return heads

    def check_integrity(self, complete: bool = False) -> None:
        """The block being assembled holds distinct ranges of the sender's split over one token
        range (and, `complete`, every one of them); else WireError DATA_LOSS, one sentence."""
        if not self.block:
            return
        have = {(r.head_start, r.head_end) for r in self.block}
        if len(have) != len(self.block) or not have <= set(self.ranges):
            raise WireError("DATA_LOSS", f"KV head ranges {_ranges(sorted(have))} are not distinct ranges of the "
                                         f"sender's split {_ranges(self.ranges)}")
        if complete:
            problem = head_problem(self.block, self.header.num_kv_heads)
            if problem:
                raise WireError("DATA_LOSS", problem)

    def feed(self, c: cluster_pb2.KVChunk) -> Pieces | None:
        """One chunk -> a KVRun (a stream without a split), the head pieces of a token block once
        its last range arrived, or None (a block still short of heads, an empty chunk)."""
        if chunk_crc(c) != c.crc32:
            raise WireError("DATA_LOSS", f"KV chunk {c.seq} of {c.request_id!r} fails its checksum")
        if c.seq != self.next_seq:
            raise WireError("DATA_LOSS", f"KV chunk {c.seq} arrived where chunk {self.next_seq} was expected")
        if c.seq == 0:
            self._open(c)
        elif c.request_id != self.request_id:
            raise WireError("INVALID_ARGUMENT", f"KV chunk {c.seq} names request {c.request_id!r} in a stream "
                                                f"for {self.request_id!r}")
        h = self.header
        if self.block and (c.start, c.num_tokens) != (self.block[0].start, self.block[0].num_tokens):
            b = self.block[0]
            missing = sorted(set(self.ranges) - {(r.head_start, r.head_end) for r in self.block})
            raise WireError("DATA_LOSS", f"KV chunk {c.seq} starts tokens [{c.start}, {c.start + c.num_tokens}) "
                                         f"while heads {_ranges(missing)} of tokens [{b.start}, {b.end}) never arrived")
        if not self.block and (c.start != self.next_pos or c.start + c.num_tokens > h.end):
            raise WireError("DATA_LOSS", f"KV chunk {c.seq} covers tokens from {c.start}, expected {self.next_pos}")
        heads = self._heads(c)
        shape = (h.num_layers, c.num_tokens, heads[1] - heads[0], h.head_dim)
        try:
            k, v = codec.decode(codec.Encoded(c.k, c.v, c.scales), self.format.name, h.dtype, shape, c.start,
                                h.page_tokens or 1, None if self.format.base == "native" else self.out_dtype)
        except codec.CodecError as e:
            raise WireError("INVALID_ARGUMENT", f"KV chunk {c.seq}: {e}") from None
        self.next_seq += 1
        self.bytes += len(c.k) + len(c.v) + len(c.scales)
        self.block.append(KVRun(h.fingerprint, c.start, k, v, np.dtype(k.dtype).name, head_start=heads[0]))
        self.check_integrity()
        if len(self.block) < len(self.ranges):
            if c.last:
                self.check_integrity(complete=True)  # names the heads missing
            return None
        self.check_integrity(complete=True)
        block, self.block = as_pieces(self.block), []
        self.next_pos += c.num_tokens
        if c.last and self.next_pos != h.end:
            raise WireError("DATA_LOSS", f"KV stream ended at token {self.next_pos}, expected {h.end}")
        if not c.num_tokens:
            return None
        return block[0] if len(block) == 1 else block


def _ranges(ranges) -> str:
    """[(0, 2), (2, 4)] -> "[0, 2) [2, 4)"."""
    return " ".join(f"[{a}, {b})" for a, b in ranges)
