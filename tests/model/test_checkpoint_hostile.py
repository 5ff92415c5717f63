"""A checkpoint directory is untrusted input: its index may not name files outside it (`..`, an
absolute name, a symlink), its weight_map must map tensor names to file names, every safetensors
header entry's shape x dtype must equal its byte range and the ranges tile the file, no tensor
is in two shards, and config.json's dimensions are bounded (`limits.py`). Each refusal is one
sentence from `load_model` and one `pddjax: error:` line from the CLI, reached without a large
allocation (`refused` watches tracemalloc's peak)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from pddjax.model.config import ModelConfig
from pddjax.model.hf_config import CheckpointError
from pddjax.model.limits import LIMITS, limits_problem
from pddjax.model.meta import model_facts
from pddjax.model.registry import load_model
from tests.support.checkpoints import copy_fixture, edit_config, edit_header, read_safetensors, refused

SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


def rewrite_index(path: str, edit) -> None:
    with open(os.path.join(path, INDEX)) as f:
        index = json.load(f)
    edit(index["weight_map"])
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump(index, f)


def outside_shard(tmp_path) -> str:
    """A valid shard 2 that lives outside any checkpoint directory."""
    os.makedirs(tmp_path / "elsewhere", exist_ok=True)
    dst = str(tmp_path / "elsewhere" / SHARD2)
    shutil.copy(os.path.join(copy_fixture(tmp_path / "src", "llama"), SHARD2), dst)
    return dst


def point_shard2(weight_map: dict, name: str) -> None:
    for k, v in weight_map.items():
        if v == SHARD2:
            weight_map[k] = name


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_shards_outside_the_directory_are_refused(tmp_path, capsys, how):
    d = copy_fixture(tmp_path, "llama")
    target = outside_shard(tmp_path)
    os.remove(os.path.join(d, SHARD2))
    if how == "symlink":
        os.symlink(target, os.path.join(d, SHARD2))
    else:
        name = os.path.relpath(target, d) if how == "dotdot" else target
        rewrite_index(d, lambda wm: point_shard2(wm, name))
    refused(d, capsys, "resolves to", "outside the checkpoint directory")


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_json_files_linked_outside_are_refused(tmp_path, capsys, name):
    d = copy_fixture(tmp_path, "llama")
    os.makedirs(tmp_path / "elsewhere")
    outside = str(tmp_path / "elsewhere" / name)
    shutil.move(os.path.join(d, name), outside)
    os.symlink(outside, os.path.join(d, name))
    refused(d, capsys, name, "outside the checkpoint directory")


def test_hub_snapshot_links_into_blobs_still_load(tmp_path):
    """The Hugging Face hub's cache: snapshots/<rev>/<file> -> ../../blobs/<hash>; and a link inside."""
    src = copy_fixture(tmp_path / "src", "llama")
    repo = tmp_path / "models--x--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    os.makedirs(snap)
    os.makedirs(blobs)
    for i, name in enumerate(sorted(os.listdir(src))):
        shutil.copy(os.path.join(src, name), blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / name)
    assert load_model(str(snap), use_cache=False).config.num_layers == 2


@pytest.mark.parametrize("weight_map,words", [
    ({"model.embed_tokens.weight": 5}, ("model.embed_tokens.weight", "not a shard file name")),
    ({"model.embed_tokens.weight": ""}, ("not a shard file name",)),
    ({"": SHARD1}, ("not a shard file name",)),
    ({"model.embed_tokens.weight": [SHARD1]}, ("not a shard file name",)),
    ({"model.embed_tokens.weight": "a\0b"}, ("not a file name",)),
    (["model.embed_tokens.weight"], ("has no weight_map",)),
])
def test_malformed_weight_map(tmp_path, capsys, weight_map, words):
    d = copy_fixture(tmp_path, "llama")
    with open(os.path.join(d, INDEX), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    refused(d, capsys, *words)


def test_a_tensor_in_two_shards_is_refused(tmp_path, capsys):
    d = copy_fixture(tmp_path, "llama")
    shutil.copy(os.path.join(d, SHARD1), os.path.join(d, "copy.safetensors"))
    rewrite_index(d, lambda wm: wm.update({"model.norm.weight": "copy.safetensors"}))
    refused(d, capsys, "tensor model.embed_tokens.weight is in both", "copy.safetensors")


@pytest.mark.parametrize("length", [1 << 63, 10**9])
def test_header_length_past_the_file(tmp_path, capsys, length):
    d = copy_fixture(tmp_path, "mistral")
    file = os.path.join(d, "model.safetensors")
    with open(file, "r+b") as f:
        f.write(length.to_bytes(8, "little"))
    refused(d, capsys, "bad header length")


def test_shape_larger_than_its_byte_range(tmp_path, capsys):
    """config.json and the header agree on a 4M x 64 embedding (1 GiB as float32) that the file
    holds 147 KB of: refused from the header, before the embedding is allocated."""
    d = copy_fixture(tmp_path, "mistral")
    edit_config(d, vocab_size=LIMITS["vocab_size"])

    def widen(header, data):
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            header[name]["shape"][0] = LIMITS["vocab_size"]
    edit_header(os.path.join(d, "model.safetensors"), widen)
    refused(d, capsys, "model.safetensors is corrupt", "needs 1073741824 bytes")


def test_tensors_sharing_bytes(tmp_path, capsys):
    """1000 layers whose tensors all point at layer 0's bytes: refused as overlapping, before the
    stacked [1000, ...] arrays (147 MB) are allocated."""
    d = copy_fixture(tmp_path, "mistral")
    edit_config(d, num_hidden_layers=1000)

    def alias(header, data):
        layer0 = {k.removeprefix("model.layers.0."): v for k, v in header.items() if k.startswith("model.layers.0.")}
        for i in range(1, 1000):
            header.update({f"model.layers.{i}.{k}": dict(v) for k, v in layer0.items()})
    edit_header(os.path.join(d, "model.safetensors"), alias)
    refused(d, capsys, "byte ranges overlap or leave gaps")


@pytest.mark.parametrize("edit,words", [
    (lambda h, data: data + b"\0" * 16, ("16 bytes after its last tensor",)),
    (lambda h, data: h["model.norm.weight"].update(dtype="Q4"), ("unknown dtype 'Q4'",)),
    (lambda h, data: h["model.norm.weight"].update(shape=[-1, -64]), ("model.norm.weight is malformed",)),
    (lambda h, data: h["model.norm.weight"].update(shape=[True] * 64), ("model.norm.weight is malformed",)),
    (lambda h, data: h["model.norm.weight"].update(data_offsets=[0]), ("model.norm.weight is malformed",)),
    (lambda h, data: h.update({"model.norm.weight": "x"}), ("model.norm.weight is malformed",)),
])
def test_malformed_header_entries(tmp_path, capsys, edit, words):
    d = copy_fixture(tmp_path, "mistral")
    edit_header(os.path.join(d, "model.safetensors"), edit)
    refused(d, capsys, *words)


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "head_dim", "intermediate_size", "max_position_embeddings"])
def test_config_dimensions_are_bounded(tmp_path, capsys, field):
    d = copy_fixture(tmp_path, "mistral")
    ours = {"hidden_size": "hidden", "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
            "intermediate_size": "ffn_hidden", "max_position_embeddings": "max_context"}.get(field, field)
    value = LIMITS[ours] + 1 if field != "num_attention_heads" else 2 * LIMITS[ours]
    heads = {"num_key_value_heads": value, "head_dim": 16} if field == "num_attention_heads" else {}
    edit_config(d, **{field: value}, **heads)
    refused(d, capsys, f"{field} {value} exceeds the supported maximum {LIMITS[ours]}")
    with pytest.raises(CheckpointError, match="exceeds the supported maximum"):
        model_facts(d)  # the router's path: no weights read, still refused


def test_config_parameter_count_is_bounded(tmp_path, capsys):
    d = copy_fixture(tmp_path, "mistral")
    edit_config(d, hidden_size=LIMITS["hidden"], num_hidden_layers=LIMITS["num_layers"],
                intermediate_size=LIMITS["ffn_hidden"], num_attention_heads=512, num_key_value_heads=512)
    refused(d, capsys, "parameters, more than the supported maximum 2e+12")


def test_real_model_sizes_are_within_bounds():
    big = dict(name="x", num_kv_heads=8, head_dim=128, tie_embeddings=False, max_context=131072)
    llama405b = ModelConfig(vocab_size=128256, hidden=16384, num_layers=126, num_heads=128, ffn_hidden=53248, **big)
    dense1t = ModelConfig(vocab_size=262144, hidden=25600, num_layers=160, num_heads=200, ffn_hidden=102400,
                          **{**big, "num_kv_heads": 8})
    assert limits_problem(llama405b, {}) is None and limits_problem(dense1t, {}) is None


@pytest.mark.parametrize("changes,words", [
    ({"max_position_embeddings": "x"}, ("max_position_embeddings", "must be a positive integer", "'x'")),
    ({"head_dim": -16}, ("head_dim", "must be a positive integer", "-16")),
    ({"num_key_value_heads": 0.5}, ("num_key_value_heads", "must be a positive integer")),
    ({"num_hidden_layers": True}, ("num_hidden_layers", "must be a positive integer")),
    ({"hidden_size": 2, "num_attention_heads": 4, "num_key_value_heads": 4}, ("smaller than num_attention_heads",)),
    ({"rope_theta": "x"}, ("rope_theta", "must be a positive number")),
    ({"rms_norm_eps": {"a": 1}}, ("rms_norm_eps", "must be a positive number")),
    ({"sliding_window": "wide"}, ("sliding_window", "must be a positive integer")),
    ({"rope_scaling": {"rope_type": "linear", "factor": "x"}}, ("factor", "must be a positive number")),
])
def test_config_values_of_the_wrong_type(tmp_path, capsys, changes, words):
    d = copy_fixture(tmp_path, "mistral")
    edit_config(d, **changes)
    refused(d, capsys, *words)


def test_fixture_headers_tile_their_files():
    """The shipped fixtures pass every check above (the checks refuse only what is wrong)."""
    from pddjax.model.hf_files import read_header
    from tests.support.paths import hf_fixture

    for arch in ("llama", "mistral", "qwen2", "qwen3"):
        for f in os.listdir(hf_fixture(arch)):
            if f.endswith(".safetensors"):
                path = os.path.join(hf_fixture(arch), f)
                assert read_header(path)[0].keys() == read_safetensors(path)[0].keys() - {"__metadata__"}


@pytest.mark.parametrize("role", ["main", "router"])
def test_a_service_refuses_a_hostile_checkpoint_in_one_line(tmp_path, role):
    """`pddjax serve ROLE --model DIR` (the service's own start, its ports open while it loads):
    exit 2 with one `pddjax: error:` line naming the refusal, no traceback, before it serves."""
    d = copy_fixture(tmp_path, "llama")
    edit_config(d, hidden_size=1 << 40)
    conf = tmp_path / "stack.toml"
    conf.write_text('model = "tiny"\n')
    run = subprocess.run([sys.executable, "-m", "serving", "serve", role, "--config", str(conf), "--port", "0",
                          "--model", d], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    errors = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(errors) == 1, run.stderr
    assert errors[0].startswith("pddjax: error:") and "hidden_size" in errors[0], errors
    assert "serving on" not in run.stdout
