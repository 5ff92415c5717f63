"""Hugging Face checkpoints of every supported architecture (tests/fixtures/hf/<arch>/, made by
tools/make_hf_tiny_fixtures.py with transformers) against transformers' own outputs on them:
config from config.json, float32 logits within 1e-4 (absolute) of transformers', greedy tokens
identical through the reference engine and the paged engine; sharded and single-file loads of
one checkpoint give equal weights; the weights cache round-trips a bf16 checkpoint in bf16.

The fixtures' smallest top-1 - top-2 logit gap over all greedy steps is >= 0.02, so a 1e-4
logit error cannot flip a greedy token: token equality here is exact, not luck."""

from __future__ import annotations

import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pddjax.engines.paged_engine import EngineConfig, PagedEngine
from pddjax.engines.reference import ReferenceEngine
from pddjax.model import weights as wmod
from pddjax.model.dense import forward_full
from pddjax.model.registry import load_model
from pddjax.model.sampling_params import SamplingParams
from tests.support.paths import hf_fixture, hf_reference

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
LOGIT_TOL = 1e-4  # absolute, float32; measured max error 1.5e-6 .. 2.7e-6 (logits of O(1-10))


@pytest.fixture(scope="module", params=ARCHS)
def loaded(request):
    return request.param, load_model(hf_fixture(request.param), use_cache=False), hf_reference(request.param)


def test_config_comes_from_config_json(loaded):
    arch, m, ref = loaded
    cfg = m.config
    features = {"scaling": cfg.rope_scaling.kind if cfg.rope_scaling else None, "tied": cfg.tie_embeddings,
                "bias": cfg.qkv_bias, "qk_norm": cfg.qk_norm, "head_dim": cfg.head_dim,
                "dtype": m.weights.embed.dtype.name}
    expected = {
        "llama": {"scaling": "llama3", "tied": True, "bias": False, "qk_norm": False, "head_dim": 16,
                  "dtype": "bfloat16"},
        "qwen2": {"scaling": None, "tied": False, "bias": True, "qk_norm": False, "head_dim": 16, "dtype": "float32"},
        "qwen3": {"scaling": None, "tied": True, "bias": False, "qk_norm": True, "head_dim": 32, "dtype": "float16"},
        "mistral": {"scaling": None, "tied": False, "bias": False, "qk_norm": False, "head_dim": 16,
                    "dtype": "float32"},
    }[arch]
    assert features == expected
    assert list(cfg.eos_token_ids) == ref["eos_token_ids"]  # generation_config.json's list included
    assert (m.weights.lm_head is None) == cfg.tie_embeddings and m.weights.layers.attn_norm.dtype == np.float32
    assert m.source == "safetensors" and m.memory["weights_mb"] > 0


def test_logits_match_transformers(loaded):
    arch, m, ref = loaded
    w = wmod.cast(m.weights, jnp.float32)
    for p in ref["prompts"]:
        ids = p["prompt_ids"] + p["greedy"][:-1]
        logits = np.asarray(forward_full(w, m.config, jnp.asarray([ids], jnp.int32)))[0]  # [T, V]
        n = len(p["prompt_ids"])
        np.testing.assert_allclose(logits[n - 1], p["logits_last_prompt"], rtol=0, atol=LOGIT_TOL, err_msg=p["name"])
        np.testing.assert_allclose(logits[-1], p["logits_last"], rtol=0, atol=LOGIT_TOL, err_msg=p["name"])
        assert logits[n - 1:].argmax(-1).tolist() == p["greedy"], p["name"]


def test_reference_engine_greedy_equals_transformers(loaded):
    arch, m, ref = loaded
    eng = ReferenceEngine(m.config, m.weights)
    for p in ref["prompts"]:
        assert eng.generate(p["prompt_ids"], SamplingParams(), ref["n_new"], ()).token_ids == p["greedy"], p["name"]


def test_paged_engine_greedy_equals_transformers(loaded):
    """All prompts batched in one paged engine (continuous batching, XLA attention)."""
    arch, m, ref = loaded
    eng = PagedEngine(m.config, m.weights, m.fingerprint,
                      EngineConfig(page_size=8, num_pages=64, max_step_tokens=64, max_rows=4, attention="xla"))
    for p in ref["prompts"]:
        eng.add(p["name"], p["prompt_ids"], SamplingParams(), ref["n_new"], ())
    out = {p["name"]: [] for p in ref["prompts"]}
    while eng.has_work():
        for ev in eng.step():
            out[ev.seq_id].append(ev.token)
    assert out == {p["name"]: p["greedy"] for p in ref["prompts"]}


def test_sharded_and_single_file_load_equal(tmp_path):
    """The llama fixture is sharded (index.json + 2 files); the same tensors in one file load equal."""
    from safetensors.numpy import load_file, save_file

    src, single = hf_fixture("llama"), tmp_path / "llama-single"
    shutil.copytree(src, single, ignore=shutil.ignore_patterns("model-*", "model.safetensors.index.json"))
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.startswith("model-") and f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    assert len([f for f in os.listdir(src) if f.startswith("model-")]) == 2 and tensors["model.norm.weight"].dtype \
        == ml_dtypes.bfloat16
    save_file(tensors, str(single / "model.safetensors"))
    a, b = load_model(src, use_cache=False), load_model(str(single), use_cache=False)
    da, db = wmod.to_dict(a.weights), wmod.to_dict(b.weights)
    assert da.keys() == db.keys() and a.config.replace(name="x") == b.config.replace(name="x")
    for k in da:
        assert da[k].dtype == db[k].dtype
        np.testing.assert_array_equal(da[k], db[k], err_msg=k)
    assert a.fingerprint == b.fingerprint  # tensor content, not file layout


def test_weights_cache_keeps_a_bf16_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("PDDJAX_CACHE_DIR", str(tmp_path / "cache"))
    cold, warm = load_model(hf_fixture("llama")), load_model(hf_fixture("llama"))
    assert (cold.source, warm.source) == ("safetensors", "weights-cache")
    assert warm.config == cold.config and warm.fingerprint == cold.fingerprint
    dc, dw = wmod.to_dict(cold.weights), wmod.to_dict(warm.weights)
    assert dc.keys() == dw.keys() and dw["wq"].dtype == ml_dtypes.bfloat16
    for k in dc:
        np.testing.assert_array_equal(dw[k], dc[k], err_msg=k)
    assert warm.tokenizer.encode("hello") == cold.tokenizer.encode("hello")


def test_new_weights_declare_logical_axes(loaded):
    """Biases and q/k norms shard like the heads they belong to (tests/engines/test_sharding.py checks the mesh)."""
    from jax.sharding import PartitionSpec

    arch, m, ref = loaded
    specs = wmod.partition_specs(m.weights)
    for name, arr in wmod.to_dict(m.weights).items():
        assert len(wmod.LOGICAL_AXES[name]) == arr.ndim, name
    if m.config.qkv_bias:
        assert specs.layers.bq == PartitionSpec(None, "model", None) == specs.layers.bk
    if m.config.qk_norm:
        assert specs.layers.q_norm == PartitionSpec(None, None)


def test_num_params_counts_every_weight(loaded, tiny):
    """`ModelConfig.num_params` (what PDDJAX_QUICK_COMPILE_MAX_PARAMS compares) equals the weights'
    element count, whatever the variant: tied or not, q/k/v biases, q/k norms."""
    import jax

    for m in (loaded[1], tiny):
        assert m.config.num_params == sum(x.size for x in jax.tree_util.tree_leaves(m.weights)), m.config.name
