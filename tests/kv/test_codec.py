"""The KV wire codec (pddjax/kv/codec.py) alone: each format's round-trip error bound, the
scales' layout (one per K/V x layer x page x KV head, pages counted from position 0), the
sizes per token against the issue's targets, and malformed payloads refused with a sentence."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import zstandard

from pddjax.kv import codec

L, K, D, S = 3, 2, 8, 16  # layers, KV heads, head dim, page tokens


def piece(T=40, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    k = (rng.standard_normal((L, T, K, D)) * rng.uniform(0.1, 8, (L, 1, K, 1))).astype(dtype)  # [L, T, K, D]
    v = rng.standard_normal((L, T, K, D)).astype(dtype)
    return k, v


def roundtrip(fmt, k, v, start, out_dtype=None):
    enc = codec.encode(k, v, start, fmt, S)
    return enc, codec.decode(enc, fmt, np.dtype(k.dtype).name, k.shape, start, S, out_dtype)


def scales_of(enc, G):
    return np.frombuffer(enc.scales, np.float32).reshape(2, L, G, K)  # [2, L, G, K]


@pytest.mark.parametrize("start", [0, 5, 16])
def test_scales_are_one_per_kv_layer_page_head_from_position_zero(start):
    """Tokens [start, start + 40) touch pages start // 16 .. (start + 39) // 16; each page's
    scale is its amax / 127 over exactly the tokens of that page in the piece."""
    k, v = piece(40)
    enc, _ = roundtrip("int8", k, v, start)
    G = (start + 39) // S - start // S + 1
    s = scales_of(enc, G)
    for g in range(G):
        lo = max(start, (start // S + g) * S) - start
        hi = min(start + 40, (start // S + g + 1) * S) - start
        for which, x in enumerate((k, v)):
            want = np.abs(x[:, lo:hi]).max(axis=(1, 3)) / 127  # [L, K]
            np.testing.assert_allclose(s[which, :, g], want, rtol=1e-6)


@pytest.mark.parametrize("start", [0, 7])
def test_int8_error_is_at_most_half_a_scale_per_element(start):
    k, v = piece(50, seed=1)
    enc, (dk, dv) = roundtrip("int8", k, v, start)
    G, g = codec.pages_touched(start, 50, S)
    s = scales_of(enc, G)
    for which, (x, got) in enumerate(((k, dk), (v, dv))):
        bound = s[which][:, g, :, None] / 2  # [L, T, K, 1]
        err = np.abs(got - x)
        assert (err <= bound * (1 + 1e-5)).all(), float((err / bound).max())
        assert (err > bound / 4).any()  # lossy for real: the bound is not vacuous
    assert np.frombuffer(enc.k, np.int8).min() >= -127 and dk.dtype == np.float32


def test_fp8_error_is_relative():
    k, v = piece(40, seed=2)
    enc, (dk, dv) = roundtrip("fp8", k, v, 0)
    G, g = codec.pages_touched(0, 40, S)
    s = scales_of(enc, G)
    for which, (x, got) in enumerate(((k, dk), (v, dv))):
        scale = s[which][:, g, :, None]  # [L, T, K, 1]
        bound = 2.0 ** -4 * np.abs(x) + 2.0 ** -10 * scale  # e4m3: 3 mantissa bits; subnormals below 2^-6
        assert (np.abs(got - x) <= bound * (1 + 1e-5)).all()
    # the page's largest value maps to e4m3's largest finite, 448
    top = np.frombuffer(enc.k, ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.abs(top).max() == 448.0


def test_bf16_is_exactly_bf16_and_native_is_exact():
    k, v = piece(33, seed=3)
    _, (bk, bv) = roundtrip("bf16", k, v, 3)
    assert np.array_equal(bk, k.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.array_equal(bv, v.astype(ml_dtypes.bfloat16).astype(np.float32))
    enc, (nk, nv) = roundtrip("native", k, v, 3)
    assert np.array_equal(nk, k) and np.array_equal(nv, v) and nk.dtype == np.float32 and enc.scales == b""
    kb, _ = piece(10, dtype=ml_dtypes.bfloat16)
    _, (nk16, _) = roundtrip("native", kb, kb, 0)
    assert nk16.dtype == ml_dtypes.bfloat16 and np.array_equal(nk16, kb)


@pytest.mark.parametrize("base", codec.BASES)
def test_zstd_is_lossless_on_top_of_its_base(base):
    k, v = piece(40, seed=4)
    _, plain = roundtrip(base, k, v, 2)
    enc, packed = roundtrip(base + "+zstd", k, v, 2)
    assert all(np.array_equal(a, b) for a, b in zip(plain, packed))
    assert zstandard.get_frame_parameters(enc.k).content_size > 0


def test_decode_into_the_receivers_dtype():
    k, v = piece(20, seed=5)
    _, (dk, _) = roundtrip("int8", k, v, 0, out_dtype="bfloat16")
    _, (fk, _) = roundtrip("int8", k, v, 0)
    assert dk.dtype == ml_dtypes.bfloat16 and np.array_equal(dk, fk.astype(ml_dtypes.bfloat16))


def test_an_all_zero_page_decodes_to_zeros():
    k, v = piece(32, seed=6)
    k[:, :16] = 0
    enc, (dk, _) = roundtrip("int8", k, v, 0)
    assert (scales_of(enc, 2)[0, :, 0] == 0).all() and (dk[:, :16] == 0).all() and np.isfinite(dk).all()


def test_bytes_per_token_meet_the_targets_for_smollm2():
    args = dict(num_layers=30, num_kv_heads=3, head_dim=64, source="float32", page_tokens=16)
    native = codec.bytes_per_token("native", **args)
    assert native == 46_080
    assert codec.bytes_per_token("bf16", **args) / native <= 0.51
    for fmt in ("int8", "fp8"):
        assert codec.bytes_per_token(fmt, **args) / native <= 0.27
    k, v = piece(64)  # page-aligned: the nominal size is the encoded size, scales included
    assert codec.encode(k, v, 0, "int8", S).nbytes == 64 * codec.bytes_per_token("int8", L, K, D, "float32", S)


@pytest.mark.parametrize("damage,words", [
    ("short_k", "needs"), ("scales", "needs"), ("negative_scale", "negative"), ("zstd_size", "holds"),
    ("not_zstd", "zstd frame"), ("format", "unknown KV wire format")])
def test_malformed_payloads_are_one_sentence(damage, words):
    k, v = piece(20, seed=7)
    fmt = "int8+zstd" if damage in ("zstd_size", "not_zstd") else "int8"
    enc = codec.encode(k, v, 0, fmt, S)
    if damage == "short_k":
        enc = codec.Encoded(enc.k[:-1], enc.v, enc.scales)
    elif damage == "scales":
        enc = codec.Encoded(enc.k, enc.v, enc.scales + b"\0\0\0\0")
    elif damage == "negative_scale":
        s = np.frombuffer(enc.scales, np.float32).copy()
        s[0] = -1
        enc = codec.Encoded(enc.k, enc.v, s.tobytes())
    elif damage == "zstd_size":  # a frame that claims more than the piece holds is never expanded
        enc = codec.Encoded(zstandard.ZstdCompressor().compress(bytes(10 * len(k.tobytes()))), enc.v, enc.scales)
    elif damage == "not_zstd":
        enc = codec.Encoded(b"not a frame", enc.v, enc.scales)
    elif damage == "format":
        fmt = "int4"
    with pytest.raises(codec.CodecError, match=words) as e:
        codec.decode(enc, fmt, "float32", k.shape, 0, S)
    assert str(e.value).count(".") <= 2 and "\n" not in str(e.value)


def test_fp8_codes_round_as_ml_dtypes_does():
    """codec.e4m3_codes (integer arithmetic, ~10x faster) against ml_dtypes' own cast, at random
    values, subnormals, every representable value and the midpoints between them (ties to even)."""
    table = np.arange(127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # 0 .. 448
    mids = (table[1:] + table[:-1]) / 2
    rng = np.random.default_rng(8)
    y = np.concatenate([rng.uniform(-448, 448, 20_000), rng.standard_normal(20_000) * 0.01, table, -table, mids,
                        -mids, np.nextafter(mids, 0), np.nextafter(mids, 448), [-0.0]]).astype(np.float32)
    assert np.array_equal(codec.e4m3_codes(y), y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def _poisoned(fmt: str, dtype, how: str) -> tuple[codec.Encoded, str]:
    """A piece whose decoded values hold a NaN or an inf, each in the way `fmt` can carry one."""
    k, v = piece(20, seed=9, dtype=dtype)
    if how in ("nan", "inf"):
        k[1, 3, 0, 2] = np.nan if how == "nan" else np.inf
    enc = codec.encode(k, v, 0, fmt, S)
    if how == "nan_code":  # fp8's NaN code under finite scales
        kb = bytearray(enc.k)
        kb[7] = 0x7F
        enc = codec.Encoded(bytes(kb), enc.v, enc.scales)
    elif how == "huge_scale":  # int8 codes are finite; code x scale overflows float32
        enc = codec.Encoded(enc.k, enc.v, np.full(len(enc.scales) // 4, 3e38, np.float32).tobytes())
    return enc, np.dtype(dtype).name


@pytest.mark.parametrize("fmt,dtype,how,out", [
    ("native", np.float32, "nan", None), ("native", np.float32, "inf", None),
    ("native", ml_dtypes.bfloat16, "nan", None), ("native", np.float16, "inf", None),
    ("native+zstd", np.float32, "nan", None), ("bf16", np.float32, "nan", None),
    ("fp8", np.float32, "nan_code", None), ("fp8+zstd", np.float32, "nan_code", None),
    ("int8", np.float32, "huge_scale", None),
    ("bf16", np.float32, "big", "float16")])  # finite on the wire, past float16's range in the pool's dtype
def test_non_finite_values_are_refused(fmt, dtype, how, out):
    if how == "big":
        k, v = piece(20, seed=9)
        k[0, 0, 0, 0] = 1e6
        enc, source = codec.encode(k, v, 0, fmt, S), "float32"
    else:
        enc, source = _poisoned(fmt.partition("+")[0], dtype, how)
        if fmt.endswith("+zstd"):
            z = zstandard.ZstdCompressor()
            enc = codec.Encoded(z.compress(enc.k), z.compress(enc.v), enc.scales)
    with pytest.raises(codec.CodecError, match="not finite"):
        codec.decode(enc, fmt, source, (L, 20, K, D), 0, S, out)


def test_a_zstd_frame_expands_at_most_to_the_piece():
    """A frame that names no size is read through a buffer of the piece's size + 1: the right
    size decodes, a bomb (64 MiB of zeros from ~2 KiB) is refused having allocated ~the piece."""
    import tracemalloc

    k, v = piece(20)
    enc = codec.encode(k, v, 0, "native", S)

    def unsized(data: bytes) -> bytes:  # a streaming compressor's frame: no content size in its header
        c = zstandard.ZstdCompressor().compressobj()
        return c.compress(data) + c.flush()
    assert zstandard.get_frame_parameters(unsized(enc.k)).content_size == zstandard.CONTENTSIZE_UNKNOWN
    got_k, _ = codec.decode(codec.Encoded(unsized(enc.k), unsized(enc.v), b""), "native+zstd", "float32", k.shape,
                            0, S)
    assert np.array_equal(got_k, k)
    bomb = unsized(bytes(64 << 20))
    assert len(bomb) < 16 << 10
    tracemalloc.start()
    try:
        with pytest.raises(codec.CodecError, match="more than"):
            codec.decode(codec.Encoded(bomb, unsized(enc.v), b""), "native+zstd", "float32", k.shape, 0, S)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(enc.k) + (256 << 10), peak  # the piece's bytes, not 64 MiB
