"""Content hashes of model files, computed once and remembered by (path, size, mtime).

A fingerprint names a model's weights on the wire (KV from another fingerprint is refused) and
keys the weight cache, so it must come from the files' content: the same checkpoint at two paths
agrees, a changed file never does. Hashing a multi-GB file takes seconds to minutes, so each
file's digest is stored under `$PDDJAX_CACHE_DIR/hashes/` keyed by its real path, size and
mtime_ns and reused while those three stay the same. Imports no tensor library (the router's
model facts live next to this).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable

from pddjax import env

log = logging.getLogger(__name__)

CHUNK = 1 << 22  # bytes hashed per read


def cache_root() -> str:
    return env.cache_dir()


def _entry_path(kind: str, path: str) -> str:
    st = os.stat(path)
    key = f"{kind}|{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"
    return os.path.join(cache_root(), "hashes", hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def remembered(kind: str, path: str, compute: Callable[[str], object]):
    """`compute(path)` (a JSON value), or its stored result for this (path, size, mtime_ns)."""
    entry = _entry_path(kind, path)
    try:
        with open(entry) as f:
            return json.load(f)["value"]
    except (OSError, ValueError, KeyError):
        pass
    value = compute(path)
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        tmp = f"{entry}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"path": os.path.realpath(path), "value": value}, f)
        os.replace(tmp, entry)
    except OSError as e:  # the store is an optimisation: never fail because of it
        log.warning("could not remember the hash of %s: %s", path, e)
    return value


def sha256_range(f, start: int, end: int) -> str:
    """sha256 (hex) of bytes [start, end) of the open binary file `f`."""
    h = hashlib.sha256()
    f.seek(start)
    left = end - start
    while left > 0:
        block = f.read(min(CHUNK, left))
        if not block:
            raise ValueError("the file ends early")
        h.update(block)
        left -= len(block)
    return h.hexdigest()


def file_sha256(path: str) -> str:
    """sha256 (hex) of the whole file, remembered."""

    def compute(p):
        with open(p, "rb") as f:
            return sha256_range(f, 0, os.fstat(f.fileno()).st_size)

    return remembered("file-sha256", path, compute)
