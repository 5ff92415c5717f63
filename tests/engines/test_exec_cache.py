"""Step executables on disk (pddjax/engines/exec_cache.py): a variant one start stored, the next
start loads without tracing or lowering it, and it runs exactly as the compiled one (the
monolithic reference's tokens, greedy and seeded, the pool updated in place); an unreadable
entry is dropped and the variant compiled again; another checkout's stale folder is removed;
`PDDJAX_EXEC_CACHE=0` neither reads nor writes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pddjax import env
from pddjax.engines import exec_cache, executables, step
from pddjax.engines.engine_config import EngineConfig
from pddjax.engines.paged_engine import PagedEngine
from pddjax.model.sampling_params import SamplingParams
from tests.support.samples import prompt

# a small engine (one row a step: 3 forwards in its covering set and 1 sampler): each test compiles
# them afresh, outside JAX's cache
CONFIG = EngineConfig(page_size=16, num_pages=64, max_step_tokens=32, max_rows=1)
JOBS = {f"r{i}": (prompt(n, i), SamplingParams(temperature=0.9, top_p=0.95, seed=i) if i % 2 else SamplingParams())
        for i, n in enumerate([3, 17])}  # a greedy decode-only prompt and a seeded one over a chunk


@pytest.fixture
def exec_dir(tmp_path, monkeypatch):
    """An empty cache folder and an empty in-process table (what a fresh process starts with)."""
    monkeypatch.setenv(env.CACHE_DIR.name, str(tmp_path))
    monkeypatch.setenv(env.EXEC_CACHE.name, "1")
    monkeypatch.setattr(step, "_executables", step.Executables(64))
    return tmp_path


def entries(root) -> list:
    return sorted(p for p in (root / "exec").rglob("*") if p.is_file() and not p.name.startswith(".tmp-"))


def tokens(tiny, ref, cover: bool = True) -> dict:
    """JOBS' tokens from a fresh engine (its cover set compiled first, or only what they use),
    checked against the reference."""
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, CONFIG)
    if cover:
        eng.precompile("cover")
    for rid, (p, params) in JOBS.items():
        eng.add(rid, p, params, 12, ())
    out = {rid: [] for rid in JOBS}
    while eng.has_work():
        for ev in eng.step():
            out[ev.seq_id].append(ev.token)
    eng.check_integrity()
    for rid, (p, params) in JOBS.items():
        assert out[rid] == ref.generate(p, params, 12, ()).token_ids, rid
    return out


def test_a_stored_variant_loads_without_tracing_and_gives_the_reference_tokens(tiny, ref, exec_dir, monkeypatch):
    first = tokens(tiny, ref)
    built = step.executables().built
    assert built > 0 and len(entries(exec_dir)) == built  # one entry per variant built
    monkeypatch.setattr(step, "_executables", step.Executables(64))  # the next start
    monkeypatch.setattr(step, "_jitted", lambda *a: pytest.fail("traced a variant the cache on disk holds"))
    assert tokens(tiny, ref) == first
    assert step.executables().built == built  # loaded ones count as built in this process, as before


def test_an_unreadable_entry_is_dropped_and_compiled_again(tiny, ref, exec_dir, monkeypatch, capsys):
    tokens(tiny, ref)
    stored = entries(exec_dir)
    stored[0].write_bytes(b"not an executable")
    monkeypatch.setattr(step, "_executables", step.Executables(64))
    tokens(tiny, ref)
    assert "dropped an unreadable step executable" in capsys.readouterr().err
    assert entries(exec_dir) == stored and stored[0].stat().st_size > 1000  # written again, whole


def test_off_neither_reads_nor_writes(tiny, ref, exec_dir, monkeypatch):
    monkeypatch.setenv(env.EXEC_CACHE.name, "0")
    tokens(tiny, ref)
    assert entries(exec_dir) == []


def test_quick_compiled_programs_are_their_own_entries_and_give_the_reference_tokens(tiny, ref, exec_dir, monkeypatch):
    """PDDJAX_QUICK_COMPILE_MAX_PARAMS: a model at the limit compiles at XLA's optimization level
    0, one parameter over it at XLA's defaults; the two are different executables on disk (the
    options are in the key), and both give the reference's tokens."""
    n = tiny.config.num_params
    monkeypatch.setenv(env.QUICK_COMPILE_MAX_PARAMS.name, str(n))
    assert executables.compiler_options(tiny.config) == executables.QUICK
    quick = tokens(tiny, ref)
    stored = entries(exec_dir)
    monkeypatch.setenv(env.QUICK_COMPILE_MAX_PARAMS.name, str(n - 1))
    assert executables.compiler_options(tiny.config) is None
    monkeypatch.setattr(step, "_executables", step.Executables(64))  # the next start
    assert tokens(tiny, ref) == quick
    assert len(entries(exec_dir)) == 2 * len(stored) and set(stored) < set(entries(exec_dir))
    monkeypatch.delenv(env.QUICK_COMPILE_MAX_PARAMS.name)
    assert executables.compiler_options(tiny.config) is None  # unset: never


def test_the_key_separates_shapes_statics_and_environments():
    sig = (("tree",), ((1, 2), "float32"))
    base = exec_cache.key(sig, {"max_q_len": 16, "impl": "xla"})
    assert base == exec_cache.key(sig, {"impl": "xla", "max_q_len": 16})  # order of statics is not a key
    assert base != exec_cache.key(sig, {"max_q_len": 32, "impl": "xla"})
    assert base != exec_cache.key((("tree",), ((1, 3), "float32")), {"max_q_len": 16, "impl": "xla"})


def test_a_stale_folder_of_other_code_is_removed_when_a_new_one_is_made(tmp_path):
    old, recent, new = (tmp_path / name for name in ("old", "recent", "new"))
    for folder in (old, recent, new):
        folder.mkdir()
    stale = time.time() - (exec_cache.STALE_DAYS + 1) * 86400
    os.utime(old, (stale, stale))
    exec_cache._remove_stale(str(tmp_path), str(new))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "recent"]


def test_the_code_in_the_key_is_what_a_trace_of_the_step_can_run():
    """Every pddjax module the step imports, transitively (the model, the attention kernels, the
    sampler, the pool); not the engine's host code, whose edits keep the cache."""
    closure = exec_cache.source_closure()
    for must in ("pddjax/engines/step.py", "pddjax/model/paged.py", "pddjax/model/layers.py",
                 "pddjax/model/sampling.py", "pddjax/model/attention/xla_paged.py", "pddjax/kv/pool.py",
                 "pddjax/model/__init__.py"):
        assert must in closure, must
    for host in ("pddjax/engines/drafter.py", "pddjax/engines/paged_engine.py", "pddjax/engines/speculate.py"):
        assert host not in closure, host


def test_a_loaded_variant_runs_at_one_device_of_eight(tmp_path):
    """In a process with 8 (fake) devices, a one-device engine's variants load onto the device
    their arguments are on, not across all 8 (a subprocess: the device count is fixed at start)."""
    code = ("import os\n"
            "from pddjax.model.jax_setup import configure\n"
            "configure(devices=8)\n"
            "import jax\n"
            "assert len(jax.devices()) == 8\n"
            "from tests.engines import test_exec_cache as t\n"
            "from pddjax.engines.reference import ReferenceEngine\n"
            "from pddjax.model.registry import load_model\n"
            "tiny = load_model('tiny')\n"
            "ref = ReferenceEngine(tiny.config, tiny.weights)\n"
            "from pddjax.engines import step\n"
            "first = t.tokens(tiny, ref, cover=False)\n"  # the variants the jobs use: stored, then loaded
            "step._executables = step.Executables(64)\n"
            "assert t.tokens(tiny, ref, cover=False) == first\n"
            "print('ok', step.executables().built)\n")
    environ = {**os.environ, env.CACHE_DIR.name: str(tmp_path), env.EXEC_CACHE.name: "1"}
    environ.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
    assert len(entries(tmp_path)) > 0


def test_the_digest_follows_code_not_comments_or_docstrings(tmp_path, monkeypatch):
    """A copy of the package's closure: a comment or a docstring edited keeps the digest, a
    changed expression in the model does not."""
    import shutil

    parent = os.path.dirname(exec_cache.PACKAGE)
    for rel in exec_cache.source_closure():
        os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
        shutil.copy(os.path.join(parent, rel), tmp_path / rel)

    def digest() -> str:
        monkeypatch.setattr(exec_cache, "PACKAGE", str(tmp_path / "pddjax"))
        exec_cache._code_digest.cache_clear()
        try:
            return exec_cache._code_digest()
        finally:
            exec_cache._code_digest.cache_clear()

    layers = tmp_path / "pddjax" / "model" / "layers.py"
    base = digest()
    text = layers.read_text()
    layers.write_text(text.replace('"""', '"""Edited. ', 1) + "\n# a comment\n")
    assert digest() == base
    layers.write_text(text + "\nSCALE = 2\n")
    assert digest() != base
