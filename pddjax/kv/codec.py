"""KV wire formats: how one piece of a canonical run (k and v [L, T, K, D]) is encoded for the
wire and decoded on import. Plain numpy (no jax: the router sizes transfers with it too).

  native  the canonical dtype's raw little-endian bytes (float32 / bfloat16 / float16): exact
  bf16    bfloat16, round to nearest even: exact to bf16; 0.5x of float32
  int8    symmetric int8 with one float32 scale per (K/V, layer, page, KV head), scale = amax / 127:
          |x - decoded| <= scale / 2 per element; ~0.25x of float32
  fp8     float8 e4m3 (ml_dtypes.float8_e4m3fn), same scale layout, scale = amax / 448: relative
          error <= 2^-4 (normals), absolute <= scale * 2^-10 (subnormals)
  F+zstd  any of them, then zstd (lossless) over the k and v bytes (the scales stay raw)

Pages are counted from position 0 in `page_tokens` tokens (the sender's page size, named in the
chunk header), so a piece that starts or ends mid-page has a partial page of its own; the
scales of a piece are [2, L, G, K] float32 (K then V), G = the pages its tokens touch.
Every decode checks the byte counts first (zstd: a frame is never expanded past the piece's
size) and the values last (NaN or inf, as decoded: refused): a malformed payload is a
CodecError, one sentence.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import zstandard

from pddjax.sizes import pow2_at_least

BASES = ("native", "bf16", "int8", "fp8")
FORMATS = (*BASES, *(f"{b}+zstd" for b in BASES))  # every name a receiver of this build decodes
SOURCE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                 "float16": np.dtype(np.float16)}
_QUANT = {"int8": (np.dtype(np.int8), 127.0), "fp8": (np.dtype(ml_dtypes.float8_e4m3fn), 448.0)}  # dtype, max
_SCALE = np.dtype("<f4")
ZSTD_LEVEL = 1  # SmolLM2's KV, 1,000 tokens: level 3 shrinks int8 0.1% more than 1 and takes 1.4x as long
# the window a frame may ask of the decoder: its piece's size, at least 8 MiB (what zstd's levels up to
# 19 use on a frame that names no size), at most zstd's default cap (128 MiB)
_MIN_WINDOW, _MAX_WINDOW = 1 << 23, 1 << 27
_E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # [256] code -> value


class CodecError(ValueError):
    """A format name or payload this build cannot decode; one sentence."""


@dataclasses.dataclass(frozen=True)
class Format:
    base: str  # one of BASES
    zstd: bool

    @property
    def name(self) -> str:
        return self.base + ("+zstd" if self.zstd else "")

    @property
    def scaled(self) -> bool:
        return self.base in _QUANT

    def value_dtype(self, source: str) -> np.dtype:
        """dtype of the values on the wire for a run in the `source` dtype."""
        if self.base == "native":
            return SOURCE_DTYPES[source]
        return np.dtype(ml_dtypes.bfloat16) if self.base == "bf16" else _QUANT[self.base][0]


def parse(name: str) -> Format:
    """"int8+zstd" -> Format("int8", True); "" is native (a sender that names no format)."""
    name = name or "native"
    if name not in FORMATS:
        raise CodecError(f"unknown KV wire format {name!r} (known: {', '.join(FORMATS)})")
    base, _, z = name.partition("+")
    return Format(base, bool(z))


def pages_touched(start: int, n: int, page_tokens: int) -> tuple[int, np.ndarray]:
    """(G, group of each token [n]) for tokens [start, start + n) in pages of page_tokens."""
    pos = np.arange(start, start + n)  # [n]
    first = start // page_tokens
    g = pos // page_tokens - first  # [n]
    return (int(g[-1]) + 1 if n else 0), g


def bytes_per_token(fmt: str, num_layers: int, num_kv_heads: int, head_dim: int, source: str = "float32",
                    page_tokens: int = 16) -> float:
    """K and V of every layer for one token in `fmt`, scales included, before zstd (nominal)."""
    f = parse(fmt)
    values = 2 * num_layers * num_kv_heads * head_dim * f.value_dtype(source).itemsize
    scales = 2 * num_layers * num_kv_heads * _SCALE.itemsize / page_tokens if f.scaled else 0.0
    return values + scales


@dataclasses.dataclass(frozen=True)
class Encoded:
    k: bytes
    v: bytes
    scales: bytes  # [2, L, G, K] float32 for int8 / fp8, else b""

    @property
    def nbytes(self) -> int:
        return len(self.k) + len(self.v) + len(self.scales)


def e4m3_codes(y: np.ndarray) -> np.ndarray:
    """float32 values with |y| <= 448 -> float8_e4m3fn codes (uint8), rounded to nearest even as
    ml_dtypes rounds, in integer arithmetic in place (ml_dtypes' own cast is ~10x slower)."""
    bits = np.ascontiguousarray(y, np.float32).view(np.uint32)
    code = bits & np.uint32(0x7FFFFFFF)  # |y|'s bits
    small = code < np.uint32(121 << 23)  # below 2^-6: e4m3 subnormals, steps of 2^-9
    code += ((code >> 20) & 1) + np.uint32(0x7FFFF)  # round to 3 mantissa bits, ties to even
    code >>= 20
    code -= np.uint32(120 << 3)  # exponent bias 127 -> 7
    if small.any():
        code[small] = np.rint(np.abs(y[small]) * np.float32(512)).astype(np.uint32)
    out = code.astype(np.uint8)
    out |= ((bits >> 24) & 0x80).astype(np.uint8)  # the sign
    return out


def _quantize(x: np.ndarray, kind: str, starts: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [L, T, K, D] float32 -> (values [L, T, K, D] in the kind's dtype, scales [L, G, K] float32)."""
    dtype, qmax = _QUANT[kind]
    amax = np.maximum.reduceat(np.abs(x).max(axis=3), starts, axis=1)  # [L, G, K]
    scale = (amax / np.float32(qmax)).astype(np.float32)  # [L, G, K]
    safe = np.where(scale > 0, scale, np.float32(1))[:, g, :, None]  # [L, T, K, 1]
    y = np.clip(x / safe, -qmax, qmax)  # [L, T, K, D] in [-qmax, qmax]
    return (np.rint(y).astype(dtype) if kind == "int8" else e4m3_codes(y).view(dtype)), scale


def encode(k: np.ndarray, v: np.ndarray, start: int, fmt: str, page_tokens: int = 16) -> Encoded:
    """k, v [L, T, K, D] of tokens [start, start + T) in a source dtype -> their wire bytes."""
    f = parse(fmt)
    if f.base == "native":
        kb, vb, sb = np.ascontiguousarray(k).tobytes(), np.ascontiguousarray(v).tobytes(), b""
    elif f.base == "bf16":
        kb, vb, sb = k.astype(ml_dtypes.bfloat16).tobytes(), v.astype(ml_dtypes.bfloat16).tobytes(), b""
    else:
        _, g = pages_touched(start, k.shape[1], page_tokens)
        starts = np.flatnonzero(np.diff(g, prepend=-1))  # [G] first token of each page
        qk, sk = _quantize(k.astype(np.float32, copy=False), f.base, starts, g)
        qv, sv = _quantize(v.astype(np.float32, copy=False), f.base, starts, g)
        kb, vb, sb = qk.tobytes(), qv.tobytes(), np.stack([sk, sv]).astype(_SCALE).tobytes()  # scales [2, L, G, K]
    if f.zstd:
        z = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        kb, vb = z.compress(kb), z.compress(vb)
    return Encoded(kb, vb, sb)


def _unzstd(data: bytes, size: int, what: str) -> memoryview:
    """A zstd frame -> exactly `size` bytes. The frame's declared size is checked first (a frame
    that names another size is refused unexpanded); the output is then read into a buffer of
    size + 1 bytes, the decoder's window held to the larger of `size` and 8 MiB, so no frame (one
    that names no size, or lies about it) makes the decompressor produce more than `size` + 1."""
    try:
        declared = zstandard.get_frame_parameters(data).content_size
    except zstandard.ZstdError:
        raise CodecError(f"the KV {what} bytes are not a zstd frame") from None
    if declared not in (size, zstandard.CONTENTSIZE_UNKNOWN):
        raise CodecError(f"the KV {what} zstd frame holds {declared} bytes, expected {size}")
    buf = bytearray(size + 1)
    got = 0
    try:
        window = min(max(pow2_at_least(size), _MIN_WINDOW), _MAX_WINDOW)
        with zstandard.ZstdDecompressor(max_window_size=window).stream_reader(data) as reader:
            view = memoryview(buf)
            while got <= size:
                n = reader.readinto(view[got:])
                if not n:
                    break
                got += n
    except zstandard.ZstdError as e:
        raise CodecError(f"the KV {what} zstd frame does not decompress: {e}") from None
    if got != size:
        raise CodecError(f"the KV {what} zstd frame holds {'more than' if got > size else 'only'} "
                         f"{min(got, size)} bytes, expected {size}")
    return memoryview(buf)[:size]


def _finite(x: np.ndarray) -> bool:
    """Every value finite (checked a layer at a time: no temporary the size of the piece)."""
    return all(np.isfinite(layer).all() for layer in x)


def decode(enc: Encoded, fmt: str, source: str, shape: tuple[int, int, int, int], start: int,
           page_tokens: int = 16, out_dtype: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Wire bytes of tokens [start, start + T) -> k, v [L, T, K, D] (shape) in `out_dtype`
    (default: native stays in `source`, the rest decode to float32). Sizes are checked first."""
    f = parse(fmt)
    if source not in SOURCE_DTYPES:
        raise CodecError(f"KV dtype {source!r} is not one of {sorted(SOURCE_DTYPES)}")
    L, T, K, D = shape
    vdt = f.value_dtype(source)
    size = L * T * K * D * vdt.itemsize
    G, g = pages_touched(start, T, page_tokens) if f.scaled else (0, None)
    scale_bytes = 2 * L * G * K * _SCALE.itemsize
    kb, vb = (_unzstd(enc.k, size, "k"), _unzstd(enc.v, size, "v")) if f.zstd else (enc.k, enc.v)
    if len(kb) != size or len(vb) != size or len(enc.scales) != scale_bytes:
        raise CodecError(f"a {fmt} KV piece of shape {tuple(shape)} needs {size} bytes each for k and v and "
                         f"{scale_bytes} of scales, got {len(kb)}, {len(vb)} and {len(enc.scales)}")
    k = np.frombuffer(kb, vdt).reshape(shape)  # [L, T, K, D]
    v = np.frombuffer(vb, vdt).reshape(shape)
    out = np.dtype(SOURCE_DTYPES[out_dtype] if out_dtype else (vdt if f.base == "native" else np.float32))
    if f.scaled:
        s = np.frombuffer(enc.scales, _SCALE).reshape(2, L, G, K)  # [2, L, G, K]
        if not np.isfinite(s).all() or (s < 0).any():
            raise CodecError(f"a {fmt} KV piece carries a scale that is negative or not finite")
        if f.base == "fp8":  # a table lookup per code (ml_dtypes' cast is ~10x slower)
            k, v = _E4M3[k.view(np.uint8)], _E4M3[v.view(np.uint8)]
        with np.errstate(over="ignore"):  # an overflow to inf is refused below
            k = k.astype(np.float32, copy=False) * s[0][:, g, :, None]  # [L, T, K, D]
            v = v.astype(np.float32, copy=False) * s[1][:, g, :, None]
    with np.errstate(over="ignore"):
        k, v = k.astype(out, copy=False), v.astype(out, copy=False)
    if not (_finite(k) and _finite(v)):  # NaN / inf would poison every cache entry built on them
        raise CodecError(f"a {fmt} KV piece carries a value that is not finite (as {out.name})")
    return k, v
