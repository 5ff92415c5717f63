"""Cache of converted weights, so a second start skips GGUF dequantization (and a checkpoint
directory's transposes) and pays only for reading the bytes.

Layout: $PDDJAX_CACHE_DIR (default ~/.cache/pddjax)/weights/<fingerprint>/ holding
`tensors/<name>.bin` (each weight's raw C-order bytes in the host dtype: float32 for GGUF, the
checkpoint's own for safetensors, bfloat16 included) and `meta.json` (config, tokenizer for a
GGUF, and per weight its dtype name, shape, byte count and crc32), so a warm start does not even
parse the GGUF's metadata. A load reads each file straight into an array allocated once
(`readinto`), so its host memory is the weights and nothing more; a save writes from the arrays
it is given, without copies. The fingerprint is the files' content hash, so a changed file never
reuses a stale cache.

A cache is written in `<fingerprint>.tmp<pid>/` and renamed into place only when complete and
synced, and never replaced once there: a reader sees a whole cache or none, and of two writers
started at once the second discards its copy. A load checks every file's size against meta.json;
`check_integrity` also checks the crc32s. A cache that fails (truncated, missing a file, of an
older layout) is dropped and rebuilt from the model files, with one log line.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import zlib

import ml_dtypes  # noqa: F401  (registers bfloat16 and the float8 names with numpy)
import numpy as np

from pddjax.model import weights as wmod
from pddjax.model.fingerprint import cache_root

log = logging.getLogger(__name__)

LAYOUT = 3  # 1: one orbax pytree; 2: one orbax checkpoint per weight (both dropped and rebuilt when met)
IO_CHUNK = 1 << 30  # bytes per read/write call (one Linux syscall moves at most ~2 GiB)
STALE_TMP_S = 3600  # a dead writer's temp dir older than this is removed by the next save


def _path(fingerprint: str) -> str:
    return os.path.join(cache_root(), "weights", fingerprint)


def _dtype(name: str) -> np.dtype:
    """A numeric numpy or ml_dtypes dtype (bfloat16, float8_*) from its name; anything else is refused."""
    try:
        dt = np.dtype(name)  # ml_dtypes, imported above, registers its names with numpy
    except TypeError:
        dt = None
    numeric = dt is not None and (dt.kind in "biuf" or dt.type.__module__.split(".")[0] == "ml_dtypes")
    if not numeric or dt.name != name:
        raise ValueError(f"weight cache meta.json names dtype {name!r}, which is not a numeric dtype")
    return dt


def _bytes(arr: np.ndarray) -> np.ndarray:
    """A flat uint8 view of the contiguous array `arr` (no copy)."""
    return arr.reshape(-1).view(np.uint8)


def _write_tensor(path: str, arr: np.ndarray) -> dict:
    """Write `arr`'s bytes to `path` (synced); its entry for meta.json."""
    arr = np.ascontiguousarray(arr)  # a copy only for a strided view (one weight at most)
    raw = memoryview(_bytes(arr))
    with open(path, "wb", buffering=0) as f:
        done = 0
        while done < len(raw):
            done += f.write(raw[done:done + IO_CHUNK])
        os.fsync(f.fileno())
    return {"dtype": arr.dtype.name, "shape": list(arr.shape), "nbytes": arr.nbytes, "crc32": zlib.crc32(raw)}


def _read_tensor(path: str, spec: dict) -> np.ndarray:
    """The array stored at `path`, after checking its size against `spec` (meta.json's entry)."""
    dt, shape = _dtype(spec["dtype"]), tuple(int(s) for s in spec["shape"])
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if min(shape, default=0) < 0 or nbytes != spec["nbytes"]:
        raise ValueError(f"meta.json's entry for {os.path.basename(path)} is inconsistent: {spec}")
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size != nbytes:
            raise ValueError(f"{os.path.basename(path)} holds {size} bytes, meta.json says {nbytes}")
        arr = np.empty(shape, dt)  # filled in place: the only copy of this weight in memory
        raw = memoryview(_bytes(arr))
        done = 0
        while done < nbytes:
            n = f.readinto(raw[done:done + IO_CHUNK])
            if not n:
                raise ValueError(f"{os.path.basename(path)} ends at byte {done} of {nbytes}")
            done += n
    return arr


def _meta(path: str) -> dict:
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("layout", 1) != LAYOUT:
        raise ValueError(f"cache layout {meta.get('layout', 1)}, this version writes {LAYOUT}")
    if not isinstance(meta.get("tensors"), dict):
        raise ValueError("meta.json has no tensor table")
    unknown = sorted(set(meta["tensors"]) - set(wmod.LOGICAL_AXES))
    if unknown:
        raise ValueError(f"meta.json names tensors no model has: {unknown[:3]}")
    return meta


def restore(fingerprint: str) -> tuple[wmod.Weights, dict] | None:
    """(weights, metadata) from the cache, or None if absent or unreadable (a broken cache is removed)."""
    path = _path(fingerprint)
    try:
        st = os.stat(path)
    except OSError:
        return None
    try:
        meta = _meta(path)
        d = {name: _read_tensor(os.path.join(path, "tensors", f"{name}.bin"), spec)
             for name, spec in meta["tensors"].items()}
        return wmod.from_dict(d), meta
    except Exception as e:  # a partial, corrupted or incompatible cache: drop it and reload from the files
        log.warning("weight cache at %s unreadable (%s); rebuilding", path, e)
        _drop(path, st)
        return None


def check_integrity(fingerprint: str) -> None:
    """Raise ValueError naming the first problem with the cache of `fingerprint`: its layout, a
    missing tensor file, a size or a crc32 that disagrees with meta.json."""
    path = _path(fingerprint)
    meta = _meta(path)
    for name, spec in meta["tensors"].items():
        arr = _read_tensor(os.path.join(path, "tensors", f"{name}.bin"), spec)
        if zlib.crc32(memoryview(_bytes(arr))) != spec["crc32"]:
            raise ValueError(f"weight cache tensor {name} does not match its crc32 in meta.json")


def save(fingerprint: str, w: wmod.Weights, meta: dict) -> None:
    """Store weights plus JSON metadata (config, tokenizer) under the fingerprint."""
    path = _path(fingerprint)
    tmp = path + f".tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _sweep(path)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "tensors"))
        specs = {name: _write_tensor(os.path.join(tmp, "tensors", f"{name}.bin"), np.asarray(arr))
                 for name, arr in wmod.to_dict(w).items()}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "layout": LAYOUT, "tensors": specs}, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.rename(tmp, path)  # fails if `path` exists: a cache is never replaced under its readers
        except OSError:
            if not os.path.isdir(path):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process published the same content first
    except OSError as e:  # the cache is an optimisation: never fail a load because of it
        log.warning("could not write weight cache at %s: %s", path, e)
        shutil.rmtree(tmp, ignore_errors=True)


def _drop(path: str, st: os.stat_result) -> None:
    """Remove the cache directory `path` if it is still the one `st` describes (not a newer one)."""
    try:
        if os.stat(path).st_ino != st.st_ino:
            return
        gone = path + f".drop{os.getpid()}"
        os.rename(path, gone)  # out of readers' sight at once, then deleted
        shutil.rmtree(gone, ignore_errors=True)
    except OSError:
        pass


def _sweep(path: str) -> None:
    """Remove the temp dirs (`.tmp<pid>`, `.drop<pid>`) of `path` left by processes that died
    more than STALE_TMP_S ago."""
    parent, base = os.path.split(path)
    for entry in os.listdir(parent):
        stem, pid = entry[:len(base)], entry[len(base):].removeprefix(".tmp").removeprefix(".drop")
        if stem != base or pid == entry[len(base):] or not pid.isdigit() or int(pid) == os.getpid():
            continue
        full = os.path.join(parent, entry)
        try:
            os.kill(int(pid), 0)
            continue  # its process still runs
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            if time.time() - os.stat(full).st_mtime > STALE_TMP_S:
                shutil.rmtree(full, ignore_errors=True)
        except OSError:
            pass
