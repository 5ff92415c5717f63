"""tools/compile_log: a process started with the hook on its path logs each XLA compile (name,
program hash, seconds, the test running); the report finds the same program compiled by two
processes, and says so when there is nothing to report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pddjax import env
from tests.support.paths import ROOT
from tools.compile_log import report

PROGRAM = "import jax, jax.numpy as jnp\njax.jit(lambda x: x * 3 + 1)(jnp.ones(4))\n"


def compile_in_a_process(folder) -> None:
    hook = os.path.join(ROOT, "tools", "compile_log")
    environ = {**os.environ, env.COMPILE_LOG.name: str(folder), "PYTHONPATH": hook,
               "PYTEST_CURRENT_TEST": "tests/x/test_y.py::test_z (call)"}
    subprocess.run([sys.executable, "-c", PROGRAM], env=environ, check=True, timeout=120, cwd=ROOT)


def test_each_compile_is_logged_and_a_program_compiled_twice_is_found(tmp_path, capsys):
    compile_in_a_process(tmp_path)
    compile_in_a_process(tmp_path)  # another process: the same program again (no persistent cache here)
    recs = report.read(str(tmp_path))
    assert {r["name"] for r in recs} >= {"jit__lambda"} and all(r["s"] > 0 for r in recs)
    assert {report.test_file(r) for r in recs} == {"tests/x/test_y.py"}
    s = report.summary(recs)
    again = {r["program"]: r for r in s["repeated"]}
    assert again["jit__lambda"]["times"] == 2 and again["jit__lambda"]["files"] == ["tests/x/test_y.py"]
    out = tmp_path / "summary.json"
    assert report.main([str(tmp_path), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["compiles"] == len(recs)
    assert "the same program compiled again" in capsys.readouterr().out


def test_an_empty_log_is_an_error_in_one_line(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == f"no compiles logged under {tmp_path}"
