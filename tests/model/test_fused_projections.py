"""Fused projections (q / k / v and gate / up joined at one device) compute the same model."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pddjax.model.config import TINY
from pddjax.model.dense import forward_full
from pddjax.model.weights import cast, for_engine, fuse_projections, init_random, to_dict


@pytest.mark.parametrize("variant", ["plain", "qkv_bias+qk_norm"])
def test_fused_forward_equals_the_separate_matrices(variant):
    cfg = TINY if variant == "plain" else dataclasses.replace(TINY, qkv_bias=True, qk_norm=True)
    w = init_random(cfg, seed=3)
    fused = fuse_projections(w)
    lw = fused.layers
    assert lw.wq is None and lw.w_gate is None and lw.wqkv.shape == (
        cfg.num_layers, cfg.hidden, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
    assert lw.w_gate_up.shape == (cfg.num_layers, cfg.hidden, 2 * cfg.ffn_hidden)
    seq = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, size=(2, 20)).astype(np.int32))
    a = np.asarray(forward_full(cast(w, jnp.float32), cfg, seq))
    b = np.asarray(forward_full(cast(fused, jnp.float32), cfg, seq))
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(b.argmax(-1), a.argmax(-1))


def test_fusing_keeps_every_other_weight_and_is_idempotent():
    w = init_random(TINY, seed=1)
    fused = fuse_projections(w)
    assert fuse_projections(fused) is fused
    names = set(to_dict(fused))
    assert names == set(to_dict(w)) - {"wq", "wk", "wv", "w_gate", "w_up"} | {"wqkv", "w_gate_up"}
    np.testing.assert_array_equal(fused.layers.wo, w.layers.wo)
    E, F = TINY.hidden, TINY.ffn_hidden
    np.testing.assert_array_equal(fused.layers.w_gate_up[:, :, F:], w.layers.w_up)
    np.testing.assert_array_equal(fused.layers.wqkv[:, :, -TINY.num_kv_heads * TINY.head_dim:],
                                  w.layers.wv.reshape(TINY.num_layers, E, -1))


def test_engines_fuse_only_on_one_device_and_when_asked(monkeypatch):
    w = init_random(TINY, seed=2)
    assert for_engine(w, one_device=True).layers.wqkv is not None
    assert for_engine(w, one_device=False) is w  # a mesh splits heads and FFN: kept apart
    monkeypatch.setenv("PDDJAX_FUSE_PROJECTIONS", "0")
    assert for_engine(w, one_device=True) is w
