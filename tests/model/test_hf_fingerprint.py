"""The fingerprint names weights by content: the same checkpoint at two paths agrees, one changed
tensor byte or config value does not, different checkpoints never do; each file is hashed once
per (path, size, mtime) and a GGUF's fingerprint is still its file's sha256."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil

import pytest

from pddjax.model import fingerprint, gguf_meta, hf_files
from pddjax.model.hf_config import config_from_dir
from tests.support.gguf_factory import write_llama_gguf
from tests.support.paths import FIXTURES

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDDJAX_CACHE_DIR", str(tmp_path / "cache"))


def fp(path: str) -> str:
    return hf_files.checkpoint_fingerprint(config_from_dir(path), hf_files.weight_files(path))


def copy(arch: str, dst) -> str:
    shutil.copytree(os.path.join(FIXTURES, "hf", arch), dst)
    return str(dst)


def test_same_checkpoint_two_paths_agree(tmp_path):
    a, b = copy("qwen3", tmp_path / "a" / "qwen3"), copy("qwen3", tmp_path / "b" / "renamed")
    assert fp(a) == fp(b) == fp(os.path.join(FIXTURES, "hf", "qwen3"))


def test_different_checkpoints_never_agree():
    prints = {arch: fp(os.path.join(FIXTURES, "hf", arch)) for arch in ARCHS}
    for x, y in itertools.combinations(ARCHS, 2):
        assert prints[x] != prints[y], (x, y)


def test_one_changed_byte_or_config_value_changes_it(tmp_path):
    base = fp(os.path.join(FIXTURES, "hf", "mistral"))
    d = copy("mistral", tmp_path / "byte")
    file = os.path.join(d, "model.safetensors")
    with open(file, "r+b") as f:  # the last byte of the data (the last tensor's)
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert fp(d) != base
    c = copy("mistral", tmp_path / "config")
    with open(os.path.join(c, "config.json")) as f:
        cfg = json.load(f)
    cfg["rope_theta"] = 10000.0
    with open(os.path.join(c, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert fp(c) != base
    cfg["transformers_version"] = "0.0.1"  # a field that does not change the model: no effect
    cfg["rope_theta"] = 1000000.0
    with open(os.path.join(c, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert fp(c) == base


def test_each_file_is_hashed_once_per_size_and_mtime(tmp_path, monkeypatch):
    d = copy("qwen2", tmp_path / "qwen2")
    first = fp(d)
    calls = []
    real = fingerprint.sha256_range
    monkeypatch.setattr(hf_files, "sha256_range", lambda *a: calls.append(a) or real(*a))
    assert fp(d) == first and calls == []  # remembered
    file = os.path.join(d, "model.safetensors")
    st = os.stat(file)
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert fp(d) == first and len(calls) > 0  # touched: hashed again, same content


def test_gguf_fingerprint_is_still_the_file_sha256(tmp_path, tiny):
    path = str(tmp_path / "t.gguf")
    write_llama_gguf(path, tiny.config, tiny.weights)
    with open(path, "rb") as f:
        want = hashlib.sha256(f.read()).hexdigest()[:16]
    assert gguf_meta.file_fingerprint(path) == want == gguf_meta.file_fingerprint(path)
