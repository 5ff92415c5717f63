"""pddjax/env.py is the one place a PDDJAX_* variable is declared and read, and docs/settings.md
lists every one: a name used anywhere in pddjax/, serving/, tools/, deploy/, the Dockerfile or the
Makefile must be declared and documented; no other module spells a knob's name as a string (it
reads `env.X.get()` or writes `env.X.name`). Values are read at call time and a bad one is a
one-sentence UserError naming the variable."""

from __future__ import annotations

import ast
import glob
import os
import re

import pytest

from pddjax import env
from pddjax.errors import UserError
from tests.support.paths import ROOT

NAME = re.compile(r"PDDJAX_[A-Z0-9_]+")
SCANNED = ("pddjax", "serving", "tools", "deploy")
SKIPPED = (os.path.join("serving", "pb"),)  # generated stubs


def sources(ext: str = "") -> list[str]:
    out = [os.path.join(ROOT, f) for f in ("Dockerfile", "Makefile")] if not ext else []
    for top in SCANNED:
        for path in glob.glob(os.path.join(ROOT, top, "**", f"*{ext}"), recursive=True):
            rel = os.path.relpath(path, ROOT)
            if os.path.isfile(path) and not rel.startswith(SKIPPED) and "__pycache__" not in rel:
                out.append(path)
    return sorted(out)


def documented() -> dict[str, list[str]]:
    """docs/settings.md's table: name -> its cells (name, type, default, who reads it, meaning)."""
    rows = {}
    with open(os.path.join(ROOT, "docs", "settings.md"), encoding="utf-8") as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| `PDDJAX_") and len(cells) == 5:
                rows[cells[0].strip("`")] = cells
    return rows


def test_every_name_in_the_tree_is_declared_and_documented():
    used: dict[str, str] = {}
    for path in sources():
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            continue
        for name in NAME.findall(text):
            used.setdefault(name, os.path.relpath(path, ROOT))
    assert len(used) >= 20, sorted(used)  # the scan sees the tree
    undeclared = {n: p for n, p in used.items() if n not in env.KNOBS}
    assert not undeclared, f"PDDJAX_* names used but not declared in pddjax/env.py: {undeclared}"
    assert set(documented()) == set(env.KNOBS), "docs/settings.md's table must list exactly pddjax/env.py's knobs"
    code = ""
    for path in sources(".py"):
        if os.path.relpath(path, ROOT) != os.path.join("pddjax", "env.py"):
            with open(path, encoding="utf-8") as f:
                code += f.read()
    attrs = {n: n[len(env.PREFIX):] for n in env.KNOBS}  # env.X, or env.x() where a default is derived
    unread = [n for n, a in attrs.items() if not re.search(rf"\b{a}\b|\b{a.lower()}\(", code)]
    assert not unread, f"declared in pddjax/env.py but used by no module: {unread}"


def test_the_table_states_each_knobs_type_and_default():
    for name, (_, kind, default, _, meaning) in documented().items():
        knob = env.KNOBS[name]
        assert kind == knob.kind, name
        if isinstance(knob.default, int | float) and not isinstance(knob.default, bool):
            assert default == format(knob.default, "g"), (name, default, knob.default)
        assert meaning, name


def test_only_pddjax_env_spells_a_knob_name():
    """Anywhere else a knob is `env.X.get()` (read) or `env.X.name` (written for a child process)."""
    spelled = []
    for path in sources(".py"):
        if os.path.relpath(path, ROOT) == os.path.join("pddjax", "env.py"):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                spelled.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.value}")
    assert not spelled, spelled


def test_values_are_read_when_asked(monkeypatch):
    monkeypatch.delenv(env.LEASE_SECONDS.name, raising=False)
    assert env.LEASE_SECONDS.get() == env.LEASE_SECONDS.default
    monkeypatch.setenv(env.LEASE_SECONDS.name, "2.5")
    assert env.LEASE_SECONDS.get() == 2.5 and env.LEASE_SECONDS.is_set()
    monkeypatch.setenv(env.LEASE_SECONDS.name, " ")  # empty: unset
    assert env.LEASE_SECONDS.get() == env.LEASE_SECONDS.default and not env.LEASE_SECONDS.is_set()
    monkeypatch.setenv(env.CPUS.name, "0,2")
    monkeypatch.setenv(env.DIE_WITH_PARENT.name, "1")
    monkeypatch.setenv(env.HEALTH_PORT.name, "50070")
    assert (env.CPUS.get(), env.DIE_WITH_PARENT.get(), env.HEALTH_PORT.get()) == ([0, 2], True, 50070)
    monkeypatch.setenv(env.CACHE_DIR.name, "/c")
    monkeypatch.delenv(env.JIT_CACHE_DIR.name, raising=False)
    assert (env.cache_dir(), env.jit_cache_dir()) == ("/c", os.path.join("/c", "jit"))


@pytest.mark.parametrize("knob, raw, words", [
    (env.STEP_EXECUTABLES, "0", "a positive integer"),
    (env.MAX_WAITING, "many", "a positive integer"),
    (env.KV_LEASE_SECONDS, "-1", "a number of seconds > 0"),
    (env.METRICS_PORT, "90x", "a port number from 1 to 65535"),
    (env.HEALTH_PORT, "70000", "a port number from 1 to 65535"),
    (env.DIE_WITH_PARENT, "yes", "1 or 0"),
    (env.CPUS, "0,a", "a comma-separated list of CPU numbers"),
])
def test_a_bad_value_is_one_sentence_naming_the_variable(monkeypatch, knob, raw, words):
    monkeypatch.setenv(knob.name, raw)
    with pytest.raises(UserError) as e:
        knob.get()
    assert str(e.value) == f"{knob.name} must be {words}, got {raw!r}"


def test_every_knob_is_declared_once_with_a_kind_and_a_meaning():
    for name, knob in env.KNOBS.items():
        assert name == knob.name and name.startswith(env.PREFIX), name
        assert knob.kind in env.KINDS and knob.meaning and "\n" not in knob.meaning, name


def test_the_command_refuses_a_bad_value_before_it_runs_anything(monkeypatch, tmp_path, capsys):
    """A knob read only on a request path (the handoff's timeout) still stops the command at start."""
    from serving.cli import main

    monkeypatch.setenv(env.HANDOFF_TIMEOUT_SECONDS.name, "-1")
    out = tmp_path / "certs"
    assert main(["certs", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"pddjax: error: {env.HANDOFF_TIMEOUT_SECONDS.name} must be a number of seconds > 0, got '-1'"]
    assert not out.exists()
