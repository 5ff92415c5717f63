"""The native XLA:CPU paged attention (native_paged.py): the per-token numpy loop's results, XLA's
within bfloat16 rounding, the layer it is pointed at, zeros for padding, every size path of the
kernel (head sizes in whole vectors or not, pages of fewer than 8 slots, blocks of 16 query
tokens over the threads), and XLA's path when the kernel cannot be built.

Tolerances as in test_paged_attention.py: float32 |err| <= 2e-5 against float64; bfloat16
within about two bf16 ulps of XLA's.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddjax.model.attention import Ragged, default_impl, native_paged, paged_attention
from tests.support.paged_attention_cases import MAX_Q_LEN, SCALE, as_np, batch_st, flat, make_batch, numpy_reference

pytestmark = pytest.mark.skipif(not native_paged.available(), reason="no C++ compiler on this machine")


@functools.cache
def compiled(max_q_len: int = MAX_Q_LEN):
    return jax.jit(flat(functools.partial(paged_attention, impl="native"), max_q_len=max_q_len))


@settings(max_examples=10, deadline=None)
@given(batch=batch_st, cfg=st.sampled_from([(8, 1), (16, 3), (32, 4)]))
def test_native_matches_numpy(batch, cfg):
    args = make_batch(*batch, *cfg, "float32")
    got = as_np(compiled()(*args))
    np.testing.assert_allclose(got, numpy_reference(*args, SCALE), atol=2e-5, rtol=0)
    assert np.all(got[int(args[3][-1]):] == 0)  # padding tokens give zeros


@settings(max_examples=6, deadline=None)
@given(batch=batch_st, cfg=st.sampled_from([(16, 3), (8, 1)]))
def test_native_bfloat16_matches_xla(batch, cfg):
    args = make_batch(*batch, *cfg, "bfloat16")
    got = as_np(compiled()(*args))
    want = as_np(jax.jit(flat(functools.partial(paged_attention, impl="xla")))(*args))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-2, rtol=1.6e-2)


def test_decode_rows_match_numpy():
    """A step of one-token rows (max_q_len 1): few query vectors a task, one dot a slot."""
    rows = [("decode", 1, 63), ("decode", 1, 0), ("empty", 1, 0), ("decode", 1, 17)]
    args = make_batch(rows, 3, 16, 3, "float32")
    got = as_np(compiled(1)(*args))
    np.testing.assert_allclose(got, numpy_reference(*args, SCALE), atol=2e-5, rtol=0)


@pytest.mark.parametrize("page_size,head_dim,group", [(4, 12, 2), (8, 8, 1), (16, 24, 4), (8, 64, 3)])
def test_odd_sizes_match_numpy(page_size, head_dim, group):
    """Head sizes not in whole 16-float blocks (or not in 8-float vectors: the scalar products),
    pages of fewer than 8 slots, and a 40-token prefill row spread over three query blocks."""
    rng = np.random.default_rng(page_size * 100 + head_dim)
    kv_heads, max_pages = 2, 64 // page_size
    q_lens, kv_lens = [40, 1, 3, 0], [56, 30, 9, 0]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_pages = 1 + 4 * max_pages
    tables = np.zeros((4, max_pages), np.int32)
    perm = rng.permutation(np.arange(1, num_pages))
    for r, n in enumerate(kv_lens):
        tables[r, :-(-n // page_size)] = perm[r * max_pages:r * max_pages + -(-n // page_size)]
    q = rng.standard_normal((48, kv_heads * group, head_dim), np.float32)
    k = rng.standard_normal((kv_heads, num_pages, page_size, head_dim), np.float32)
    v = rng.standard_normal((kv_heads, num_pages, page_size, head_dim), np.float32)
    rows = Ragged(jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables), 40, head_dim**-0.5)
    got = np.asarray(jax.jit(lambda q, k, v, rows: paged_attention(q, k, v, rows, impl="native"))(q, k, v, rows))
    want = numpy_reference(q, k, v, cu, np.asarray(kv_lens), tables, head_dim**-0.5)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    assert np.all(got[int(cu[-1]):] == 0)


def test_whole_pool_with_layer_index_reads_that_layer():
    """The engine hands the kernel the 5-D pool and a traced layer index: the layer's own pages."""
    rows = [("decode", 1, 30), ("extend", 5, 20), ("empty", 1, 0), ("prefill", 12, 9)]
    q, k, v, cu, kv, pt = make_batch(rows, 7, 8, 3, "float32")
    k5 = jnp.stack([k * (layer + 1) for layer in range(3)])  # [L, KH, P, S, D]
    v5 = jnp.stack([v - layer for layer in range(3)])
    f = jax.jit(flat(functools.partial(paged_attention, impl="native")))
    for layer in (0, 2):
        got = f(q, k5, v5, cu, kv, pt, layer=jnp.int32(layer))
        want = numpy_reference(q, k5[layer], v5[layer], cu, kv, pt, SCALE)
        np.testing.assert_allclose(as_np(got), want, atol=2e-5, rtol=0)


def test_float16_takes_xla_path():
    """A dtype the kernel does not take runs XLA's attention (same results), not an error."""
    rows = [("decode", 1, 30), ("extend", 5, 20), ("empty", 1, 0), ("prefill", 12, 9)]
    q, k, v, cu, kv, pt = (x.astype(jnp.float16) if x.dtype == jnp.float32 else x
                           for x in make_batch(rows, 5, 8, 1, "float32"))
    assert native_paged.problem(q, k) is not None
    got = jax.jit(flat(functools.partial(paged_attention, impl="native")))(q, k, v, cu, kv, pt)
    want = jax.jit(flat(functools.partial(paged_attention, impl="xla")))(q, k, v, cu, kv, pt)
    np.testing.assert_array_equal(as_np(got), as_np(want))


def test_auto_picks_native_on_cpu():
    assert default_impl("cpu") == "native"
    assert default_impl("gpu") == "pallas"


def test_without_a_compiler_auto_falls_back_to_xla(tmp_path):
    """No compiler (CXX names a missing program, nothing built in a fresh cache): `auto` is XLA's,
    with the reason logged, and asking for "native" by name is refused with a sentence."""
    code = ("import logging; logging.basicConfig()\n"
            "from pddjax.model.attention import default_impl\n"
            "print('impl', default_impl('cpu'))\n"
            "from pddjax.engines.engine_config import EngineConfig\n"
            "from pddjax.engines.paged_engine import PagedEngine\n"
            "from pddjax.model.registry import load_model\n"
            "m = load_model('tiny')\n"
            "try:\n"
            "    PagedEngine(m.config, m.weights, m.fingerprint, EngineConfig(attention='native'))\n"
            "except ValueError as e:\n"
            "    print('refused', e)\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "PDDJAX_CACHE_DIR": str(tmp_path / "cache"),
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "impl xla" in done.stdout
    assert "refused attention 'native' is unavailable" in done.stdout
    assert "native paged attention unavailable" in done.stderr


@pytest.mark.parametrize("rows,k,n", [(1, 70, 37), (1, 300, 48), (2, 70, 48), (5, 300, 48), (7, 70, 37),
                                      (8, 300, 48), (13, 70, 37), (64, 300, 100)])
def test_the_product_reads_a_stacked_weight_in_panels_in_place(rows, k, n):
    """layers.mm with an InPlace weight (in panels) and 1-64 rows (native/gemm.cc): x @ w[layer] of
    the stacked [L, K, N], with rows not in whole register blocks, K over more than one block of
    rows, and N not in whole panels (the last one padded with zeros)."""
    from pddjax.model import layers, weights

    rng = np.random.default_rng(rows * 1000 + k + n)
    w = jnp.asarray(rng.standard_normal((3, k, n)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    panels = weights.to_panels(w)
    assert panels.data.shape == (3, -(-n // 16), k, 16) and panels.n == n
    f = jax.jit(lambda x, p, i: layers.mm(x, layers.InPlace(p, i)))
    assert "pddjax_gemm" in f.lower(x, panels, jnp.int32(0)).as_text()
    for i in (0, 2):
        want = np.asarray(x, np.float64) @ np.asarray(w[i], np.float64)
        np.testing.assert_allclose(np.asarray(f(x, panels, jnp.int32(i))), want, rtol=1e-4, atol=1e-4)
        one_layer = jax.tree_util.tree_map(lambda a, i=i: a[i], panels)  # as the layer scan slices it (XLA's path)
        np.testing.assert_allclose(np.asarray(layers.mm(x, one_layer)), want, rtol=1e-4, atol=1e-4)


def _tiny_forward_native_and_xla(max_q_len: int, batch_of):
    """The tiny model's paged forward of batch_of(cfg) over a random 16-page pool, native (the
    weights in panels, as a native engine holds them) and XLA -> (the native program's HLO text,
    its logits, XLA's logits)."""
    from pddjax.kv.pool import KVPool
    from pddjax.model.paged import forward_paged
    from pddjax.model.registry import load_model
    from pddjax.model.weights import for_engine, in_panels

    m = load_model("tiny")
    cfg, w = m.config, jax.device_put(for_engine(m.weights, one_device=True))
    shape = KVPool.zeros(cfg.num_layers, cfg.num_kv_heads, 16, 16, cfg.head_dim, "float32").k.shape
    pool = KVPool(jax.random.normal(jax.random.key(0), shape), jax.random.normal(jax.random.key(1), shape))
    batch = batch_of(cfg)
    got, want = (jax.jit(functools.partial(forward_paged, cfg=cfg, max_q_len=max_q_len, impl=impl))
                 for impl in ("native", "xla"))
    panels = in_panels(w)
    text = got.lower(panels, batch=batch, pool=pool).as_text()
    return text, np.asarray(got(panels, batch=batch, pool=pool)[0]), np.asarray(want(w, batch=batch, pool=pool)[0])


def test_a_one_row_step_takes_the_in_place_products():
    """The tiny model's forward at one token: the native path calls the in-place product (and no
    layer slice of the four weights) and gives XLA's logits (float32 rounding, same argmax)."""
    from pddjax.model.paged import PackedBatch

    i32 = functools.partial(np.asarray, dtype=np.int32)
    text, a, b = _tiny_forward_native_and_xla(1, lambda cfg: PackedBatch(
        i32([7]), i32([20]), i32([2]), i32([4]), i32([0, 1]), i32([21]), i32([[1, 2, 0, 0]]), i32([0])))
    assert "pddjax_gemm" in text
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert (a.argmax(-1) == b.argmax(-1)).all()


@pytest.mark.parametrize("tokens,in_place", [(3, True), (80, False)])
def test_a_step_of_few_tokens_takes_the_in_place_products(tokens, in_place):
    """The tiny model's forward with one row of `tokens` new tokens: up to IN_PLACE_MAX_TOKENS the
    native path runs the products in place (gemm), beyond it XLA's over the weights in panels (the
    LM head in place either way: its rows are the step's last tokens); the logits are XLA's (over
    the weights as stored) either way."""
    from pddjax.model import layers
    from pddjax.model.paged import PackedBatch

    assert (tokens <= layers.IN_PLACE_MAX_TOKENS) == in_place
    i32 = functools.partial(np.asarray, dtype=np.int32)
    ctx = 20  # KV positions before the new tokens; pages 1.. hold the row
    positions = ctx + np.arange(tokens)
    table = np.zeros((1, 8), np.int32)
    table[0, :-(-(ctx + tokens) // 16)] = 1 + np.arange(-(-(ctx + tokens) // 16))
    text, a, b = _tiny_forward_native_and_xla(tokens, lambda cfg: PackedBatch(
        i32(np.arange(tokens) % cfg.vocab_size), i32(positions), i32(1 + positions // 16), i32(positions % 16),
        i32([0, tokens]), i32([ctx + tokens]), table, i32([tokens - 1])))
    assert text.count("pddjax_gemm") == (5 if in_place else 1), text.count("pddjax_gemm")  # the head: always
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert (a.argmax(-1) == b.argmax(-1)).all()


@pytest.mark.parametrize("tied", [True, False])
def test_weights_in_panels_embed_and_project_as_stored(tied):
    """weights.in_panels: a token's embedding read from the head's panels (tied: the embedding is
    held once) and the logits through the in-place head equal those of the weights as stored."""
    from pddjax.model import layers, weights
    from pddjax.model.registry import load_model

    m = load_model("tiny")
    w = weights.for_engine(m.weights, one_device=True)
    if not tied:
        w = w.replace(lm_head=jnp.asarray(np.random.default_rng(3).standard_normal(w.embed.T.shape), jnp.float32))
    elif w.lm_head is not None:
        w = w.replace(lm_head=None)
    panels = weights.in_panels(w)
    assert (panels.embed is None) == tied and isinstance(panels.lm_head, weights.Panels)
    tokens = jnp.asarray([0, 5, 17, m.config.vocab_size - 1], jnp.int32)
    np.testing.assert_array_equal(np.asarray(layers.embed(panels, tokens)), np.asarray(layers.embed(w, tokens)))
    h = jnp.asarray(np.random.default_rng(4).standard_normal((3, m.config.hidden)), jnp.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(layers.logits, static_argnums=2)(panels, h, m.config)),
                               np.asarray(layers.logits(w, h, m.config)), rtol=1e-4, atol=1e-4)


def test_a_rows_product_does_not_depend_on_the_other_rows():
    """The in-place product gives a row the same bits whether it comes alone, with 2 rows or with
    20: the sums run over the same blocks of K in the same order for any number of rows."""
    from pddjax.model import layers, weights

    rng = np.random.default_rng(5)
    w = weights.to_panels(jnp.asarray(rng.standard_normal((2, 600, 64)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((20, 600)), jnp.float32)
    f = jax.jit(lambda x, w: layers.mm(x, layers.InPlace(w, jnp.int32(1))))
    every = np.asarray(f(x, w))
    np.testing.assert_array_equal(np.asarray(f(x[:2], w)), every[:2])
    np.testing.assert_array_equal(np.asarray(f(x[:1], w)), every[:1])


@pytest.mark.parametrize("n", [64, 70, 5])
def test_panels_laid_out_on_the_host_are_placed_without_a_copy(n):
    """weights.to_panels of a numpy weight: the same panels as from a device array (the last panel
    zero-padded past N), in an aligned host buffer that `cast` hands to XLA as it is."""
    from pddjax.model import weights

    w = np.random.default_rng(6).standard_normal((2, 33, n)).astype(np.float32)
    host, device = weights.to_panels(w), weights.to_panels(jnp.asarray(w))
    assert isinstance(host.data, np.ndarray) and host.data.ctypes.data % weights.ALIGN == 0
    assert host.n == device.n == n
    np.testing.assert_array_equal(host.data, np.asarray(device.data))
    placed = weights.cast(weights.Weights(embed=np.zeros((4, 33), np.float32), final_norm=np.ones(33, np.float32),
                                          lm_head=host, layers=weights.LayerWeights(*[None] * 9)), jnp.float32)
    assert isinstance(placed.lm_head.data, jax.Array)
    assert placed.lm_head.data.unsafe_buffer_pointer() == host.data.ctypes.data  # no copy
