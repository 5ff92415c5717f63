"""The test suite's layout rules (issue 29), so that they cannot drift:

  (a) the tests/ tree mirrors the source: every folder of tests/ that holds Python files is the
      mirror of a source package (tests/kv of pddjax/kv, tests/serving/router of
      serving/router) or one of the named extra folders; each is a package (__init__.py);
  (b) every fixture is defined once: no fixture name is defined in two places in tests/ (a
      fixture several folders use lives in the conftest.py of the lowest folder above them all);
  (c) no module of tests/ imports a test module or a conftest: shared code is in tests/support/.

Each rule is a function returning its violations; the tests run it on this tree, and on a made-up
tree that breaks it (so each check is shown able to fail)."""

from __future__ import annotations

import ast
import os

from tests.support.paths import ROOT

TESTS = os.path.join(ROOT, "tests")
SOURCE_ROOTS = ("", "pddjax")  # tests/serving/... mirrors serving/..., tests/kv mirrors pddjax/kv
EXTRA_FOLDERS = {"support", "fixtures", "serving/pipelines", "deploy", "tools"}  # relative to tests/


def _python_files(tests_dir: str):
    """(path relative to tests_dir, absolute path) of every .py file under tests_dir, fixtures aside."""
    for dirpath, dirnames, filenames in os.walk(tests_dir):
        dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "fixtures") and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                yield os.path.relpath(path, tests_dir), path


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def stray_folders(tests_dir: str, root: str) -> list[str]:
    """Folders of tests_dir holding Python files that mirror no source package (under `root`) and
    are no named extra; or that are no package themselves."""
    problems = []
    folders = sorted({os.path.dirname(rel) for rel, _ in _python_files(tests_dir)} - {""})
    for rel in folders:
        posix = rel.replace(os.sep, "/")
        if not os.path.exists(os.path.join(tests_dir, rel, "__init__.py")):
            problems.append(f"tests/{posix}: no __init__.py")
        extra = any(posix == e or posix.startswith(e + "/") for e in EXTRA_FOLDERS)
        mirrored = any(os.path.exists(os.path.join(root, src, rel, "__init__.py")) for src in SOURCE_ROOTS)
        if not (extra or mirrored):
            packages = " nor ".join(os.path.join(src, posix) + "/" if src else posix + "/" for src in SOURCE_ROOTS)
            problems.append(f"tests/{posix}: mirrors no source package (neither {packages}) and is no named extra")
    return problems


def _fixture_name(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The name `fn` is a fixture under (its `name=` if given), or None if it is no fixture."""
    for dec in fn.decorator_list:
        call = dec if isinstance(dec, ast.Call) else None
        target = call.func if call else dec
        dotted = ast.unparse(target)
        if dotted in ("pytest.fixture", "fixture", "pytest_asyncio.fixture"):
            for kw in call.keywords if call else []:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                    return kw.value.value
            return fn.name
    return None


def duplicate_fixtures(tests_dir: str) -> dict[str, list[str]]:
    """{fixture name: where it is defined} for every name defined in more than one place."""
    where: dict[str, list[str]] = {}
    for rel, path in _python_files(tests_dir):
        for node in ast.walk(_parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = _fixture_name(node)
                if name is not None:
                    where.setdefault(name, []).append(f"tests/{rel}:{node.lineno}")
    return {name: places for name, places in sorted(where.items()) if len(places) > 1}


def _is_test_module(tests_dir: str, module: str) -> bool:
    """`module` ("tests.kv.test_codec") names a test module or a conftest of tests_dir."""
    parts = module.split(".")
    if parts[0] != "tests" or not (parts[-1] == "conftest" or parts[-1].startswith("test_")):
        return False
    return os.path.exists(os.path.join(tests_dir, *parts[1:]) + ".py")


def imports_of_test_modules(tests_dir: str) -> list[str]:
    """Imports, anywhere in tests_dir, of a test module (tests/**/test_*.py) or a conftest."""
    problems = []
    for rel, path in _python_files(tests_dir):
        package = ["tests", *os.path.dirname(rel).split(os.sep)] if os.path.dirname(rel) else ["tests"]
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module or ""
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                if _is_test_module(tests_dir, t):
                    problems.append(f"tests/{rel}:{node.lineno} imports {t}")
    return problems


# ---- the rules on this tree ------------------------------------------------------------------
def test_every_test_folder_mirrors_a_source_package_or_is_a_named_extra():
    assert stray_folders(TESTS, ROOT) == []


def test_no_fixture_is_defined_twice():
    assert duplicate_fixtures(TESTS) == {}


def test_no_module_imports_a_test_module():
    assert imports_of_test_modules(TESTS) == []


# ---- each check fails on a tree that breaks its rule ----------------------------------------
def _write(path, text: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_checks_find_what_breaks_the_rules(tmp_path):
    root, tests = tmp_path, tmp_path / "tests"
    for pkg in ("pddjax", "pddjax/kv", "serving", "serving/router"):
        _write(root / pkg / "__init__.py")
    for good in ("kv", "serving", "serving/router", "serving/pipelines", "support"):
        _write(tests / good / "__init__.py")
        _write(tests / good / "test_ok.py", "def test_ok():\n    pass\n")
    _write(tests / "__init__.py")
    assert stray_folders(str(tests), str(root)) == []
    assert duplicate_fixtures(str(tests)) == {} and imports_of_test_modules(str(tests)) == []

    _write(tests / "widgets" / "__init__.py")  # mirrors nothing
    _write(tests / "widgets" / "test_w.py")
    _write(tests / "serving" / "router" / "sub" / "test_s.py")  # no __init__.py, and no serving/router/sub
    assert stray_folders(str(tests), str(root)) == [
        "tests/serving/router/sub: no __init__.py",
        "tests/serving/router/sub: mirrors no source package (neither serving/router/sub/ nor "
        "pddjax/serving/router/sub/) and is no named extra",
        "tests/widgets: mirrors no source package (neither widgets/ nor pddjax/widgets/) and is no named extra"]

    fixture = "import pytest\n\n\n@pytest.fixture(scope='module')\ndef ref():\n    return 1\n"
    _write(tests / "conftest.py", fixture)
    _write(tests / "kv" / "test_a.py", fixture)
    _write(tests / "serving" / "test_b.py", "from pytest import fixture\n\n\n@fixture(name='ref')\ndef other():\n"
                                             "    return 2\n\n\n@fixture\nasync def once():\n    return 3\n")
    assert duplicate_fixtures(str(tests)) == {
        "ref": ["tests/conftest.py:5", "tests/kv/test_a.py:5", "tests/serving/test_b.py:5"]}

    _write(tests / "serving" / "router" / "test_c.py",
           "from tests.kv.test_ok import test_ok\nfrom tests.serving import test_ok as t\nimport tests.kv.test_ok\n"
           "from . import test_ok as u\nfrom ..pipelines.test_ok import test_ok as v\nfrom tests import conftest\n"
           "from tests.support import test_ok as w\nfrom tests.support.paths import ROOT\nimport os.path\n")
    assert imports_of_test_modules(str(tests)) == [
        "tests/serving/router/test_c.py:1 imports tests.kv.test_ok",
        "tests/serving/router/test_c.py:2 imports tests.serving.test_ok",
        "tests/serving/router/test_c.py:3 imports tests.kv.test_ok",
        "tests/serving/router/test_c.py:4 imports tests.serving.router.test_ok",
        "tests/serving/router/test_c.py:5 imports tests.serving.pipelines.test_ok",
        "tests/serving/router/test_c.py:6 imports tests.conftest",
        "tests/serving/router/test_c.py:7 imports tests.support.test_ok"]
