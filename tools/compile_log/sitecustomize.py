"""Every XLA compile of a process, logged: put this folder on PYTHONPATH and set
`env.COMPILE_LOG` (a folder), and each Python process that starts (pytest's workers, the stacks'
services) appends one JSON line per compile to DIR/<pid>.jsonl: the program's name, a hash of
its StableHLO without locations (the same program compiled twice hashes the same), wall and
process-CPU seconds, and the test running (PYTEST_CURRENT_TEST, inherited by a test's children).
`python -m tools.compile_log.report DIR` sums them. A development tool: it wraps JAX's private
`compiler.backend_compile_and_load` when that module is first imported; nothing else changes."""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import json
import os
import sys
import time

from pddjax import env  # (light: no jax)

_OUT = env.COMPILE_LOG.get()


def _record(module, seconds: float, cpu: float) -> None:
    try:
        from jax._src.lib.mlir import ir

        name = ir.StringAttr(module.operation.attributes["sym_name"]).value
        lines = (ln.split(" loc(")[0] for ln in str(module).splitlines() if not ln.startswith("#loc"))
        digest = hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12]
    except Exception:  # noqa: BLE001 - a record without a name is still a compile counted
        name, digest = "?", "?"
    rec = {"name": name, "hash": digest, "s": seconds, "cpu": cpu, "pid": os.getpid(),
           "test": os.environ.get("PYTEST_CURRENT_TEST", ""), "argv": " ".join(sys.argv[:3])[:200]}
    with open(os.path.join(_OUT, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def _wrap(compiler) -> None:
    original = compiler.backend_compile_and_load

    def backend_compile_and_load(backend, module, *args, **kwargs):
        t0, c0 = time.monotonic(), time.process_time()
        out = original(backend, module, *args, **kwargs)
        _record(module, time.monotonic() - t0, time.process_time() - c0)
        return out

    compiler.backend_compile_and_load = backend_compile_and_load


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps jax._src.compiler right after it is first executed (importing it here would be circular)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "jax._src.compiler":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _wrap(module)

        spec.loader.exec_module = exec_module
        return spec


if _OUT:
    os.makedirs(_OUT, exist_ok=True)
    sys.meta_path.insert(0, _Finder())
