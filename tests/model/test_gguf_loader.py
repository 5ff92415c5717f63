"""The GGUF loader on files we write ourselves: exact for F32, within quantization error for
F16/Q8_0/Q4_0/Q4_1, Q/K permutation undone, config and tokenizer from metadata."""

import jax.numpy as jnp
import numpy as np
import pytest

from pddjax.model.dense import forward_full
from pddjax.model.registry import load_model
from pddjax.model.weights import cast, to_dict
from tests.support.gguf_factory import write_llama_gguf

TOL = {"F32": 0.0, "F16": 2e-3, "Q8_0": 2e-2, "Q4_0": 0.35, "Q4_1": 0.3}  # max abs error per unit-ish weight


@pytest.fixture(scope="module")
def tiny_tied(tiny):
    cfg = tiny.config.replace(tie_embeddings=True)
    w = tiny.weights.replace(lm_head=None)
    return cfg, w


def test_f32_gguf_round_trips_exactly(tmp_path, tiny):
    cfg, w = tiny.config, tiny.weights
    path = str(tmp_path / "tiny-f32.gguf")
    write_llama_gguf(path, cfg, w)
    m = load_model(path, use_cache=False)
    assert m.config.rms_eps == pytest.approx(cfg.rms_eps)  # stored as float32 in GGUF
    assert m.config.replace(name="tiny", rms_eps=cfg.rms_eps) == cfg
    for name, arr in to_dict(w).items():
        np.testing.assert_array_equal(to_dict(m.weights)[name], np.asarray(arr), err_msg=name)
    seq = jnp.asarray([[5, 9, 300, 4, 77, 8]], jnp.int32)
    a = forward_full(cast(w, jnp.float32), cfg, seq)
    b = forward_full(cast(m.weights, jnp.float32), m.config, seq)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1"])
def test_quantized_types_dequantize_within_error(tmp_path, tiny_tied, qtype):
    cfg, w = tiny_tied
    path = str(tmp_path / f"tiny-{qtype}.gguf")
    kinds = ["embed", "q", "k", "v", "o", "gate", "up", "down"]
    write_llama_gguf(path, cfg, w, {k: qtype for k in kinds})
    m = load_model(path, use_cache=False)
    assert m.config.tie_embeddings and m.weights.lm_head is None
    got = to_dict(m.weights)
    for name, arr in to_dict(w).items():
        arr = np.asarray(arr)
        scale = np.abs(arr).max()
        assert np.abs(got[name] - arr).max() <= TOL[qtype] * scale + 1e-6, name


def test_unpermute_restores_hf_rope_layout(tmp_path, tiny):
    """A wrong (or missing) Q/K unpermute changes attention: F32 logits must match exactly."""
    cfg, w = tiny.config, tiny.weights
    path = str(tmp_path / "t.gguf")
    write_llama_gguf(path, cfg, w, {"q": "F16", "k": "F16"})
    m = load_model(path, use_cache=False)
    np.testing.assert_allclose(np.asarray(m.weights.layers.wq), np.asarray(w.layers.wq), atol=2e-3)
    np.testing.assert_allclose(np.asarray(m.weights.layers.wk), np.asarray(w.layers.wk), atol=2e-3)


def test_tokenizer_from_metadata(tmp_path, tiny):
    path = str(tmp_path / "t.gguf")
    write_llama_gguf(path, tiny.config, tiny.weights)
    tok = load_model(path, use_cache=False).tokenizer
    ids = tok.encode("hello world 42")
    assert tok.decode(ids) == "hello world 42"
    assert tok.encode("hello")[0] == tok.tok.token_to_id("hell")  # merges applied
    assert len(tok.encode("42")) == 2  # smollm pre-tokenizer splits digits
    assert tok.encode("<|im_start|>hi") == [1] + tok.encode("hi")  # control token recognised


def test_weights_cache_round_trip(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("PDDJAX_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "t.gguf")
    write_llama_gguf(path, tiny.config, tiny.weights, {"q": "Q8_0"})
    cold = load_model(path)
    warm = load_model(path)
    assert (cold.source, warm.source) == ("gguf", "weights-cache")
    assert warm.config == cold.config and warm.fingerprint == cold.fingerprint
    for name, arr in to_dict(cold.weights).items():
        np.testing.assert_array_equal(to_dict(warm.weights)[name], arr)
    assert warm.tokenizer.encode("hello world") == cold.tokenizer.encode("hello world")
