"""Compiled step executables on disk, found without tracing or lowering.

JAX's persistent compilation cache skips XLA's compile, but finds its entry by hashing the
lowered program, so every start still traces and lowers each step variant it builds (on a
warm start of the tiny model ~2 of a service's ~4 s; of the real model's whole set, tracing
8-9 s and lowering 15-17 s). This cache keys a variant by what decides its program instead:

  - the code the step's trace can run (`source_closure`: pddjax/engines/step.py and every
    pddjax module it imports, transitively, as syntax trees: an edit of that code is a new key,
    one of a comment or docstring is not); jax's and jaxlib's
    versions, the devices (platform, kind, count), XLA_FLAGS and every jax config value;
  - the step's argument signature (tree structure; each leaf's shape, dtype, sharding, weak
    type) and its statics (model config, max row length, attention implementation, ...).

An entry is the executable as `jax.experimental.serialize_executable` writes it, with its
argument and result tree structures (pickled), under `<cache>/exec/<code digest>/<key>`,
written to a temporary file and renamed into place (concurrent writers of one key write the
same bytes). One that does not load is deleted and the variant compiled as before. Only
single-device steps use it (a sharded step's executable names its mesh's devices). When a new
code digest's folder is made, sibling folders untouched for `STALE_DAYS` are removed.
`PDDJAX_EXEC_CACHE=0` turns it off.

A variant bound for this cache is compiled afresh (`fresh_compile`), never taken from JAX's
persistent cache, so the first start after an edit of that source compiles its variants cold:
an XLA:CPU executable JAX loaded from its cache serializes without some of its kernels
("Function ..._fusion not found" when the copy runs). JAX has no per-call switch for
its cache (whether it is used is decided once per process), so `fresh_compile` makes JAX's
private `compiler._get_cache_key` answer None on this thread only; where that function is
missing (another JAX) this cache stays off.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time

import jax

from pddjax import env

STALE_DAYS = 7
_NOT_IN_KEY = ("jax_platforms",)  # config values that cannot change a compiled program (`_environment`)


PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the pddjax package


def source_closure(module: str = "pddjax.engines.step") -> list[str]:
    """The files of `module` and of every pddjax module it imports, transitively (imports inside
    functions too; each module's package __init__ files with it): all the code a trace of the
    step can run, besides jax's and numpy's. Paths relative to the package's parent, sorted."""
    return sorted(_parsed_closure(module))


def _parsed_closure(module: str) -> dict:
    """`source_closure`'s files -> their syntax trees (each file read and parsed once)."""
    parent, trees, todo = os.path.dirname(PACKAGE), {}, [module]
    while todo:
        parts = todo.pop().split(".")
        for i in range(1, len(parts) + 1):  # the packages on the way, then the module itself
            base = os.path.join(parent, *parts[:i])
            path = base + ".py" if os.path.isfile(base + ".py") else os.path.join(base, "__init__.py")
            rel = os.path.relpath(path, parent)
            if rel in trees or not os.path.isfile(path):
                continue
            with open(path, encoding="utf-8") as f:
                trees[rel] = tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    todo += [a.name for a in node.names if a.name.split(".")[0] == "pddjax"]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("pddjax"):
                    todo += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return trees


@functools.cache
def _code_digest() -> str:
    """sha256 over `source_closure()` but this file (each file's path and its syntax tree without
    docstrings; comments never reach the tree), computed once: an edit to the engine's host code
    (the scheduler, the drafter) or to a comment or docstring keeps the cache, one to the model's
    code does not."""
    h, trees = hashlib.sha256(), _parsed_closure("pddjax.engines.step")
    for rel in sorted(trees):
        if rel == os.path.join("pddjax", "engines", "exec_cache.py"):
            continue  # the cache's own code computes nothing in a step
        tree = trees[rel]
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        h.update(rel.encode() + b"\0" + ast.dump(tree).encode() + b"\0")
    return h.hexdigest()[:32]


@functools.cache
def _environment() -> str:
    """What outside the step's arguments decides its program: versions, devices, flags, JAX's
    config values but `jax_platforms` (which backends a process starts: the backend chosen and
    its devices are in the key already, so a service pinned to "cpu" and a process that found
    the CPU by default share their executables)."""
    devices = jax.devices()
    config = sorted((k, repr(v)) for k, v in jax.config.values.items() if k not in _NOT_IN_KEY)
    return repr((jax.__version__, jax.lib.__version__,  # jax, jaxlib
                 jax.default_backend(), len(devices),
                 sorted({d.device_kind for d in devices}), os.environ.get("XLA_FLAGS", ""), config))


def key(signature: tuple, statics: dict) -> str:
    """The entry's file name for a variant (its code digest is the folder)."""
    return hashlib.sha256(repr((_environment(), signature, sorted(statics.items()))).encode()).hexdigest()


def _folder() -> str:
    return os.path.join(env.cache_dir(), "exec", _code_digest())


def enabled() -> bool:
    return env.EXEC_CACHE.get() and _bypass_installed()


_fresh = threading.local()


@functools.cache
def _bypass_installed() -> bool:
    """Wrap JAX's cache-key function so that it answers None (no cache) inside `fresh_compile`."""
    from jax._src import compiler

    original = getattr(compiler, "_get_cache_key", None)
    if original is None:
        return False

    def get_cache_key(*args, **kwargs):
        return None if getattr(_fresh, "on", False) else original(*args, **kwargs)

    compiler._get_cache_key = get_cache_key
    return True


@contextlib.contextmanager
def fresh_compile():
    """Compiles on this thread inside skip JAX's persistent cache (neither read nor written)."""
    _fresh.on = True
    try:
        yield
    finally:
        _fresh.on = False


def load(name: str, devices: list):
    """The executable stored under `name`, loaded to run on `devices` (the one its arguments are
    on; by default a loaded executable spans every device of the backend), or None (absent, or
    unreadable: then deleted)."""
    path = os.path.join(_folder(), name)
    try:
        with open(path, "rb") as f:
            payload, in_tree, out_tree = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a torn or foreign entry: compile instead
        return _drop(path, e)
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        return deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
    except Exception as e:  # noqa: BLE001 - an entry this backend cannot load: compile instead
        return _drop(path, e)


def store(name: str, compiled) -> None:
    """Write `compiled` under `name` (atomically); a failure is reported and otherwise ignored."""
    from jax.experimental.serialize_executable import serialize

    folder = _folder()
    try:
        if not os.path.isdir(folder):
            os.makedirs(folder, exist_ok=True)
            _remove_stale(os.path.dirname(folder), folder)
        data = pickle.dumps(serialize(compiled), protocol=pickle.HIGHEST_PROTOCOL)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(folder, name))
    except Exception as e:  # noqa: BLE001 - the cache is an optimisation: serving goes on
        print(f"pddjax: could not store a step executable in {folder}: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)


def _drop(path: str, why: Exception) -> None:
    print(f"pddjax: dropped an unreadable step executable {path}: {type(why).__name__}: {why}", file=sys.stderr,
          flush=True)
    try:
        os.unlink(path)
    except OSError:
        pass
    return None


def _remove_stale(parent: str, keep: str) -> None:
    """Remove code-digest folders other than `keep` untouched for STALE_DAYS (an older checkout's)."""
    cutoff = time.time() - STALE_DAYS * 86400
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if path != keep and os.path.isdir(path) and os.path.getmtime(path) < cutoff:
            shutil.rmtree(path, ignore_errors=True)
