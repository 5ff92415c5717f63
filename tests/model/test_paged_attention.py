"""Paged attention: XLA reference == numpy per-token loop; Pallas (interpret) == XLA.

Tolerances, on outputs of magnitude O(1) (inputs ~ N(0, 1)):
  float32:  XLA vs numpy (float64) and Pallas vs XLA, |err| <= 2e-5.
  bfloat16: Pallas vs XLA, |err| <= 1e-2 + 1.6e-2 * |ref| (about two bf16 ulps: both round
            the output to bf16, and the kernel rounds probabilities to bf16 before the PV
            matmul while the reference keeps them in float32).
Shapes are static per configuration, so hypothesis examples within one reuse the compile.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddjax.model.attention import paged_attention, write_kv
from pddjax.model.attention.pallas_paged import choose_blocks, paged_attention_pallas
from tests.support.paged_attention_cases import (
    CONFIGS,
    KV_HEADS,
    MAX_KV,
    NUM_ROWS,
    SCALE,
    as_np,
    batch_st,
    flat,
    make_batch,
    numpy_reference,
)


@functools.cache
def compiled(impl: str, block_backend: str | None = None):
    if impl == "xla":
        fn = functools.partial(paged_attention, impl="xla")
    else:
        def fn(q, k, v, rows):
            blocks = choose_blocks("cpu" if block_backend == "split" else block_backend,
                                   page_size=k.shape[2], group=q.shape[1] // k.shape[0],
                                   max_q_len=rows.max_q_len, head_dim=q.shape[2], num_rows=NUM_ROWS,
                                   num_kv_heads=KV_HEADS, max_pages=MAX_KV // k.shape[2])
            if block_backend == "split":
                blocks = dataclasses.replace(blocks, pages_per_block=1, kv_splits=3)
            return paged_attention_pallas(q, k, v, rows, blocks=blocks, interpret=True)
    return jax.jit(flat(fn))


@pytest.mark.parametrize("page_size,group,dtype,blocks_of", CONFIGS)
@settings(max_examples=6, deadline=None)
@given(batch=batch_st)
def test_pallas_matches_xla(page_size, group, dtype, blocks_of, batch):
    args = make_batch(*batch, page_size, group, dtype)
    got = as_np(compiled("pallas", blocks_of)(*args))
    want = as_np(compiled("xla")(*args))
    assert np.isfinite(got).all()
    assert np.all(got[int(args[3][-1]):] == 0)  # padding tokens give zeros
    if dtype == "float32":
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    else:
        np.testing.assert_allclose(got, want, atol=1e-2, rtol=1.6e-2)


@settings(max_examples=10, deadline=None)
@given(batch=batch_st, cfg=st.sampled_from([(8, 1), (16, 3), (32, 4)]))
def test_xla_matches_numpy(batch, cfg):
    args = make_batch(*batch, *cfg, "float32")
    got = as_np(compiled("xla")(*args))
    np.testing.assert_allclose(got, numpy_reference(*args, SCALE), atol=2e-5, rtol=0)
    assert np.all(got[int(args[3][-1]):] == 0)


decode_st = st.tuples(st.lists(st.tuples(st.sampled_from(["empty", "decode"]), st.just(1), st.integers(0, MAX_KV)),
                               min_size=NUM_ROWS, max_size=NUM_ROWS), st.integers(0, 2**32 - 1))


@settings(max_examples=10, deadline=None)
@given(batch=decode_st, cfg=st.sampled_from([(8, 1), (16, 3), (32, 4)]))
def test_xla_decode_form_matches_numpy(batch, cfg):
    """A step of one-token rows runs its own product order (K on the left, `max_q_len` 1): the
    same attention, within float32 rounding of the per-token loop."""
    q, k, v, cu, kv, pt = make_batch(*batch, *cfg, "float32")
    fn = jax.jit(flat(functools.partial(paged_attention, impl="xla"), max_q_len=1))
    got = as_np(fn(q, k, v, cu, kv, pt))
    np.testing.assert_allclose(got, numpy_reference(q, k, v, cu, kv, pt, SCALE), atol=2e-5, rtol=0)
    assert np.all(got[int(cu[-1]):] == 0)


def test_write_kv_scatters_and_padding_hits_scratch():
    pool = jnp.zeros((2, 4, 8, 3))  # [KH, P, S, D]
    k_new = jnp.arange(3 * 2 * 3, dtype=jnp.float32).reshape(3, 2, 3) + 1  # [T, KH, D]
    pages, offs = jnp.array([2, 3, 0]), jnp.array([5, 0, 0])  # token 2 is padding -> page 0
    k2, v2 = write_kv(pool, pool, k_new, -k_new, pages, offs)
    np.testing.assert_array_equal(k2[:, 2, 5], k_new[0])
    np.testing.assert_array_equal(v2[:, 3, 0], -k_new[1])
    assert float(jnp.abs(k2[:, 1]).sum()) == 0.0  # other pages untouched
    np.testing.assert_array_equal(pool, 0)  # inputs are not mutated


def test_kernel_lowers_to_triton_for_cuda():
    """The Pallas -> Triton lowering (which rejects non-power-of-two tiles) runs on CPU."""
    T, H, KH, D, P, S, B, MP = 32, 9, 3, 64, 33, 16, 4, 8  # real-model heads: 9 q / 3 kv
    shapes = [((T, H, D), jnp.bfloat16), ((KH, P, S, D), jnp.bfloat16), ((KH, P, S, D), jnp.bfloat16),
              ((B + 1,), jnp.int32), ((B,), jnp.int32), ((B, MP), jnp.int32)]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    for max_q_len in (1, 32):  # decode (kv splits > 1) and prefill tiles
        fn = flat(functools.partial(paged_attention_pallas, backend="gpu", interpret=False), max_q_len, 0.125)
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text


def test_whole_pool_with_layer_index_reads_that_layer():
    """The engine hands the kernel the 5-D pool and a (traced) layer index: same result as
    the layer's own slice, with no slice materialized."""
    rows = [("decode", 1, 30), ("extend", 5, 20), ("empty", 1, 0), ("prefill", 12, 9)]
    q, k, v, cu, kv, pt = make_batch(rows, 7, 8, 3, "float32")
    L = 3
    k5 = jnp.stack([k * (layer + 1) for layer in range(L)])  # [L, KH, P, S, D]
    v5 = jnp.stack([v - layer for layer in range(L)])
    for impl in ("xla", "pallas"):
        f = jax.jit(flat(functools.partial(paged_attention, impl=impl)))
        for layer in (0, 2):
            got = f(q, k5, v5, cu, kv, pt, layer=jnp.int32(layer))
            want = compiled("xla")(q, k5[layer], v5[layer], cu, kv, pt)
            np.testing.assert_allclose(as_np(got), as_np(want), atol=2e-5, rtol=0)


def test_whole_pool_kernel_lowers_to_triton_for_cuda():
    T, H, KH, D, P, S, B, MP, L = 8, 9, 3, 64, 33, 16, 4, 8, 30
    shapes = [((T, H, D), jnp.bfloat16), ((L, KH, P, S, D), jnp.bfloat16), ((L, KH, P, S, D), jnp.bfloat16),
              ((B + 1,), jnp.int32), ((B,), jnp.int32), ((B, MP), jnp.int32), ((), jnp.int32)]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    fn = flat(functools.partial(paged_attention_pallas, backend="gpu", interpret=False), 1, 0.125)
    text = jax.jit(lambda *a: fn(*a[:6], layer=a[6])).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
