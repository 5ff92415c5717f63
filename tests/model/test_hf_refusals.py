"""Checkpoint directories we cannot load are refused with one sentence naming what is wrong, and
`pddjax generate --model DIR` exits 2 with that sentence: an unknown architecture, a sliding
window, unsupported rope scaling or biases, missing files, a corrupt or truncated safetensors
file, a missing, unexpected, misshapen or integer tensor."""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pddjax.model.registry import load_model
from tests.support.checkpoints import copy_fixture, edit_config, refused


def edit_tensors(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_unknown_architecture(tmp_path, capsys):
    d = copy_fixture(tmp_path, "mistral")
    edit_config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    refused(d, capsys, "unsupported architecture", "GPT2LMHeadModel", "LlamaForCausalLM")


def test_sliding_window_refused_unless_it_spans_the_context(tmp_path, capsys):
    d = copy_fixture(tmp_path, "mistral")
    edit_config(d, sliding_window=128)  # < max_position_embeddings 512
    refused(d, capsys, "sliding_window 128", "not supported")
    edit_config(d, sliding_window=512)  # covers the whole context: full attention
    assert load_model(d, use_cache=False).config.max_context == 512


def test_qwen2_sliding_window_only_when_used(tmp_path, capsys):
    d = copy_fixture(tmp_path, "qwen2")  # sliding_window 512, use_sliding_window false: loads
    edit_config(d, sliding_window=64)
    load_model(d, use_cache=False)
    edit_config(d, use_sliding_window=True)
    refused(d, capsys, "sliding_window 64")


@pytest.mark.parametrize("field,value,words", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, ("'yarn'", "not supported")),
    ("attention_bias", True, ("attention_bias",)),
    ("hidden_act", "gelu", ("hidden_act", "gelu")),
    ("quantization_config", {"quant_method": "awq"}, ("quantization_config",)),
])
def test_unsupported_fields(tmp_path, capsys, field, value, words):
    d = copy_fixture(tmp_path, "mistral")
    edit_config(d, **{field: value})
    refused(d, capsys, *words)


def test_missing_files(tmp_path, capsys):
    d = copy_fixture(tmp_path, "mistral")
    os.remove(os.path.join(d, "model.safetensors"))
    refused(d, capsys, "has no model.safetensors")
    os.remove(os.path.join(d, "config.json"))
    refused(d, capsys, "no config.json")
    refused(str(tmp_path / "nowhere"), capsys, "unknown model")
    s = copy_fixture(tmp_path, "llama")
    os.remove(os.path.join(s, "model-00002-of-00002.safetensors"))
    refused(s, capsys, "model-00002-of-00002.safetensors", "missing")


def test_truncated_and_corrupt_safetensors(tmp_path, capsys):
    d = copy_fixture(tmp_path, "mistral")
    file = os.path.join(d, "model.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[:-1000])
    refused(d, capsys, "truncated or corrupt")
    with open(file, "wb") as f:
        f.write(b"\xff" * 8 + data[8:])
    refused(d, capsys, "not a safetensors file")
    with open(file, "wb") as f:
        f.write(data[:8] + b"#" + data[9:])
    refused(d, capsys, "not a safetensors file")


def test_bad_config_json(tmp_path, capsys):
    d = copy_fixture(tmp_path, "mistral")
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write("{not json")
    refused(d, capsys, "config.json", "JSON")


def test_missing_unexpected_misshapen_and_integer_tensors(tmp_path, capsys):
    d = copy_fixture(tmp_path, "mistral")
    edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    refused(d, capsys, "lacks tensor model.layers.1.mlp.up_proj.weight")
    d = copy_fixture(tmp_path / "b", "mistral")
    edit_tensors(d, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}))
    refused(d, capsys, "model.layers.0.self_attn.o_proj.bias", "does not call for")
    d = copy_fixture(tmp_path / "c", "mistral")
    edit_tensors(d, lambda t: t.update({"model.norm.weight": np.ones(65, np.float32)}))
    refused(d, capsys, "model.norm.weight", "[65]", "[64]")
    d = copy_fixture(tmp_path / "d", "mistral")
    edit_tensors(d, lambda t: t.update({"model.norm.weight": np.ones(64, np.int8)}))
    refused(d, capsys, "model.norm.weight", "I8")
