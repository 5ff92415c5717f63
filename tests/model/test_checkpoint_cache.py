"""The weights cache (pddjax/model/checkpoint_cache.py): each weight's raw bytes round-trip in
its own dtype (float32, bfloat16, int8, float8); a truncated, missing or inconsistent file, a
hostile dtype or tensor name and a cache of an older (orbax) layout are each dropped with one
log line and rebuilt from the model files; a failed writer publishes nothing; a second writer
never replaces a published cache; a load adds no host memory beyond the weights themselves."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

from pddjax.model import checkpoint_cache as cc
from pddjax.model import weights as wmod
from pddjax.model.memwatch import PeakMemory
from pddjax.model.registry import load_model
from tests.support.gguf_factory import write_llama_gguf

FP = "fp-test"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDDJAX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "weights"


@pytest.fixture(scope="module")
def mixed(tiny):
    """The tiny model's weights in four dtypes (norms float32, as engines keep them)."""
    d = {k: np.asarray(v) for k, v in wmod.to_dict(tiny.weights).items()}
    d["embed"] = d["embed"].astype(ml_dtypes.bfloat16)
    d["wq"] = (d["wq"] * 50).astype(np.int8)
    d["wk"] = d["wk"].astype(ml_dtypes.float8_e4m3fn)
    d["w_up"] = d["w_up"].transpose(0, 2, 1).copy().transpose(0, 2, 1)  # not C-order: stored in C order
    return wmod.from_dict(d)


def cache_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == cc.__name__ and r.levelno == logging.WARNING]


def test_round_trip_keeps_every_dtype_and_value(cache, mixed):
    cc.save(FP, mixed, {"config": {"x": 1}, "tokenizer": {"t": 2}})
    cc.check_integrity(FP)
    w, meta = cc.restore(FP)
    want, got = wmod.to_dict(mixed), wmod.to_dict(w)
    assert got.keys() == want.keys() and (meta["config"], meta["tokenizer"]) == ({"x": 1}, {"t": 2})
    assert {got[k].dtype.name for k in ("embed", "wq", "wk", "attn_norm")} == {"bfloat16", "int8", "float8_e4m3fn",
                                                                                 "float32"}
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k].view(np.uint8), np.ascontiguousarray(want[k]).view(np.uint8), err_msg=k)
    assert sorted(os.listdir(cache / FP / "tensors")) == sorted(f"{k}.bin" for k in want)
    assert meta["layout"] == cc.LAYOUT and meta["tensors"]["embed"]["dtype"] == "bfloat16"


def test_absent_cache_is_none(cache):
    assert cc.restore(FP) is None


def corrupt_truncate(path):
    with open(path / "tensors" / "wv.bin", "r+b") as f:
        f.truncate(os.path.getsize(path / "tensors" / "wv.bin") - 1)


def corrupt_missing(path):
    os.remove(path / "tensors" / "w_down.bin")


def corrupt_meta_size(path):
    meta = json.loads((path / "meta.json").read_text())
    meta["tensors"]["wo"]["shape"][0] += 1
    (path / "meta.json").write_text(json.dumps(meta))


def corrupt_dtype(path):
    meta = json.loads((path / "meta.json").read_text())
    meta["tensors"]["wo"]["dtype"] = "object"
    (path / "meta.json").write_text(json.dumps(meta))


def corrupt_name(path):
    meta = json.loads((path / "meta.json").read_text())
    meta["tensors"]["../../escape"] = meta["tensors"].pop("wo")
    (path / "meta.json").write_text(json.dumps(meta))


def corrupt_json(path):
    (path / "meta.json").write_text('{"layout": 3, "tens')


@pytest.mark.parametrize("corrupt", [corrupt_truncate, corrupt_missing, corrupt_meta_size, corrupt_dtype, corrupt_name,
                                     corrupt_json])
def test_a_broken_cache_is_dropped_with_one_log_line(cache, mixed, caplog, corrupt):
    cc.save(FP, mixed, {})
    corrupt(cache / FP)
    with pytest.raises((ValueError, OSError)):
        cc.check_integrity(FP)
    assert cc.restore(FP) is None
    assert len(cache_warnings(caplog)) == 1 and "rebuilding" in cache_warnings(caplog)[0]
    assert os.listdir(cache) == []  # dropped, not left for the next reader
    cc.save(FP, mixed, {})
    cc.check_integrity(FP)


def test_check_integrity_finds_a_flipped_byte(cache, mixed):
    cc.save(FP, mixed, {})
    with open(cache / FP / "tensors" / "w_gate.bin", "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ValueError, match="w_gate does not match its crc32"):
        cc.check_integrity(FP)


@pytest.mark.parametrize("layout", [1, 2])
def test_an_older_layout_is_dropped_and_rebuilt(tmp_path, monkeypatch, tiny, caplog, layout):
    """An orbax cache (layout 1: one pytree, 2: one checkpoint per weight) at the fingerprint's path."""
    monkeypatch.setenv("PDDJAX_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "t.gguf")
    write_llama_gguf(path, tiny.config, tiny.weights)
    fp = load_model(path, use_cache=False).fingerprint
    old = tmp_path / "cache" / "weights" / fp
    (old / "tensors" / "wq").mkdir(parents=True)
    (old / "tensors" / "wq" / "_METADATA").write_text("{}")
    (old / "meta.json").write_text(json.dumps({"tensors": ["wq"], **({"layout": 2} if layout == 2 else {})}))
    assert load_model(path).source == "gguf"
    assert cache_warnings(caplog) == [f"weight cache at {old} unreadable (cache layout {layout}, this version writes "
                                      f"{cc.LAYOUT}); rebuilding"]
    assert not (old / "tensors" / "wq").exists()
    cc.check_integrity(fp)
    assert load_model(path).source == "weights-cache"


def test_a_truncated_file_rebuilds_through_the_loader(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("PDDJAX_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "t.gguf")
    write_llama_gguf(path, tiny.config, tiny.weights, {"q": "Q8_0"})
    cold = load_model(path)
    corrupt_truncate(tmp_path / "cache" / "weights" / cold.fingerprint)
    again, warm = load_model(path), load_model(path)
    assert (cold.source, again.source, warm.source) == ("gguf", "gguf", "weights-cache")
    for name, arr in wmod.to_dict(cold.weights).items():
        np.testing.assert_array_equal(wmod.to_dict(warm.weights)[name], arr)


def test_a_failed_writer_publishes_nothing(cache, mixed, monkeypatch, caplog):
    real, calls = cc._write_tensor, []

    def fail_third(path, arr):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(path, arr)

    monkeypatch.setattr(cc, "_write_tensor", fail_third)
    cc.save(FP, mixed, {})  # never raises: the cache is an optimisation
    assert cc.restore(FP) is None and os.listdir(cache) == []
    assert len(cache_warnings(caplog)) == 1 and "No space left" in cache_warnings(caplog)[0]


def test_a_second_writer_never_replaces_a_published_cache(cache, mixed, tiny):
    cc.save(FP, mixed, {"who": "first"})
    ino = os.stat(cache / FP).st_ino
    cc.save(FP, tiny.weights, {"who": "second"})
    assert os.stat(cache / FP).st_ino == ino and cc.restore(FP)[1]["who"] == "first"
    assert os.listdir(cache) == [FP]  # the second's temp dir is gone


def test_a_killed_processs_temp_dirs_are_not_read_and_are_swept(cache, mixed):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # a process that has exited
    stale, dropped, live = cache / f"{FP}.tmp{dead_pid}", cache / f"{FP}.drop{dead_pid}", cache / f"{FP}.tmp1"
    for d in (stale, dropped, live):  # pid 1 is alive
        (d / "tensors").mkdir(parents=True)
        (d / "meta.json").write_text("{}")
        old = time.time() - cc.STALE_TMP_S - 60
        os.utime(d, (old, old))
    assert cc.restore(FP) is None  # a temp dir is never a cache
    cc.save(FP, mixed, {})
    assert sorted(os.listdir(cache)) == sorted([FP, live.name])


def test_a_load_adds_no_host_memory_beyond_the_weights(cache, tiny):
    big = np.random.default_rng(0).standard_normal((64, 1 << 18), dtype=np.float32)  # [64, 262144]: 64 MiB
    cc.save(FP, tiny.weights.replace(embed=big), {})
    with PeakMemory(interval_s=0.001) as mem:
        w, _ = cc.restore(FP)
    s = mem.summary()
    assert s["anon_peak_mb"] - s["anon_before_mb"] <= big.nbytes / (1 << 20) + 8
    np.testing.assert_array_equal(w.embed, big)
