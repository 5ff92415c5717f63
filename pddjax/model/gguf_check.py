"""A GGUF file's header walked against the file's size before the `gguf` package reads it.

The package trusts the header: an array whose length runs past the end of the file makes its
reader loop (and grow a list) for up to 2^64 steps, and its tensor sizes are products that wrap
around in uint64. Here every count, string length, array length, tensor rank, dimension, type,
offset and byte size is checked against the bytes that are actually there (Python integers, no
overflow), tensors may not overlap, and nothing is allocated but the walk's own small values, so
a hostile file is one sentence (`gguf_meta.open_reader` raises it as GGUFError) before any tensor
is built.

Layout (GGUF v2/v3): magic "GGUF", u32 version, u64 tensor count, u64 metadata count; each
metadata entry a string key, a u32 type and its value (a string is u64 length + bytes, an array
a u32 element type + u64 length + elements); each tensor a string name, u32 rank, u64 dims, u32
GGML type, u64 offset into the data section, which starts at the next multiple of the alignment.
"""

from __future__ import annotations

import math
import mmap
import os
import struct

SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
STRING, ARRAY, UINT32 = 8, 9, 4
MAX_COUNT = 1 << 24  # tensors or metadata entries in one file
MAX_RANK = 4  # GGML_MAX_DIMS


class _Bad(Exception):
    """Ends the walk with the reason (a clause) the file is refused."""


class _Walk:
    """A read cursor over the file's bytes that refuses to step past their end."""

    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos = buf, order, 0

    def fail(self, reason: str):
        raise _Bad(reason)

    def take(self, n: int, what: str) -> int:
        if n > len(self.buf) - self.pos:
            self.fail(f"its {what} runs past the end of the file")
        self.pos += n
        return self.pos - n

    def uint(self, fmt: str, what: str) -> int:
        at = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(self.order + fmt, self.buf, at)[0]

    def string(self, what: str) -> bytes:
        n = self.uint("Q", what)
        at = self.take(n, what)
        return self.buf[at:at + n]

    def count(self, what: str, min_bytes: int) -> int:
        n = self.uint("Q", what)
        if n > MAX_COUNT or n * min_bytes > len(self.buf) - self.pos:
            self.fail(f"it claims {n} {what}, more than the file can hold")
        return n

    def value(self, vtype: int, what: str) -> None:
        if vtype in SCALAR_BYTES:
            self.take(SCALAR_BYTES[vtype], what)
        elif vtype == STRING:
            self.string(what)
        elif vtype == ARRAY:
            itype = self.uint("I", what)
            if itype == ARRAY or (itype != STRING and itype not in SCALAR_BYTES):
                self.fail(f"metadata {what} is an array of unsupported element type {itype}")
            n = self.uint("Q", what)
            if n * (8 if itype == STRING else SCALAR_BYTES[itype]) > len(self.buf) - self.pos:
                self.fail(f"metadata array {what} of {n} elements runs past the end of the file")
            if itype == STRING:
                for _ in range(n):
                    self.string(what)
            else:
                self.take(n * SCALAR_BYTES[itype], what)
        else:
            self.fail(f"metadata {what} has unknown type {vtype}")


def header_problem(path: str) -> str | None:
    """Why the GGUF at `path` cannot be read safely (a clause), or None (see the module docstring)."""
    if os.path.getsize(path) < 24:
        return "it is too short"
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            _walk(_Walk(buf, "<"))
        except _Bad as e:
            return str(e)
    return None


def _walk(w: _Walk) -> None:
    buf = w.buf
    if bytes(buf[:4]) != b"GGUF":
        w.fail("it does not start with the GGUF magic")
    w.take(4, "magic")
    version = w.uint("I", "version")
    if version & 0xFFFF == 0:  # written on a big-endian machine
        w.order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        w.fail(f"version {version} (supported: 2, 3)")
    n_tensors, n_fields = w.count("tensors", 24), w.count("metadata entries", 13)
    alignment = _metadata(w, n_fields)
    _tensors(w, n_tensors, alignment)


def _metadata(w: _Walk, n_fields: int) -> int:
    """Step over the metadata entries; -> the data alignment (general.alignment, else 32)."""
    alignment = 32
    for _ in range(n_fields):
        key = bytes(w.string("metadata key"))
        vtype = w.uint("I", "metadata type")
        if key == b"general.alignment":
            if vtype != UINT32:
                w.fail("general.alignment is not a u32")
            alignment = w.uint("I", "general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                w.fail(f"general.alignment {alignment} is not a power of two")
            continue
        w.value(vtype, key.decode("utf-8", "replace"))
    return alignment


def _tensors(w: _Walk, n_tensors: int, alignment: int) -> None:
    """Every tensor's rank, dims, type and offset; their byte spans inside the data section, apart."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    spans = []
    for _ in range(n_tensors):
        name = bytes(w.string("tensor name")).decode("utf-8", "replace")
        rank = w.uint("I", f"tensor {name}")
        if not 1 <= rank <= MAX_RANK:
            w.fail(f"tensor {name} has rank {rank} (at most {MAX_RANK})")
        dims = [w.uint("Q", f"tensor {name}") for _ in range(rank)]
        raw_type = w.uint("I", f"tensor {name}")
        try:
            block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
        except (ValueError, KeyError):
            w.fail(f"tensor {name} has unknown GGML type {raw_type}")
        if min(dims) < 1 or dims[0] % block:
            w.fail(f"tensor {name} has dimensions {dims}, not positive multiples of its block of {block}")
        offset = w.uint("Q", f"tensor {name}")
        if offset % alignment:
            w.fail(f"tensor {name} starts at offset {offset}, not a multiple of the alignment {alignment}")
        spans.append((offset, offset + math.prod(dims) // block * type_bytes, name))
    data_start = -(-w.pos // alignment) * alignment
    end = 0
    for begin, stop, name in sorted(spans):
        if begin < end:
            w.fail(f"tensor {name} overlaps the tensor before it")
        if data_start + stop > len(w.buf):
            w.fail(f"tensor {name} runs past the end of the file")
        end = stop
