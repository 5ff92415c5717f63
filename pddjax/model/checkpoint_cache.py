"""Orbax cache of converted weights, so a second start skips GGUF dequantization (and a
checkpoint directory's transposes).

Layout: $PDDJAX_CACHE_DIR (default ~/.cache/pddjax)/weights/<fingerprint>/ holding one orbax
checkpoint per weight (`tensors/<name>/`, in the host dtype: float32 for GGUF, the checkpoint's
own for safetensors) and `meta.json` (config, tokenizer for a GGUF, the tensor names), so a warm
start does not even parse the GGUF's metadata. One checkpoint per weight because orbax copies
what it saves and restores: a single pytree of everything doubled the host memory of a load
(2.1 GB of bf16 weights peaked at 5.9 GB while saving); per weight the extra is the largest
one. The fingerprint is the files' content hash, so a changed file never reuses a stale cache.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np

from pddjax.model import weights as wmod
from pddjax.model.fingerprint import cache_root

log = logging.getLogger(__name__)

LAYOUT = 2  # 1: one pytree under weights/ (dropped and rebuilt when met)


def _path(fingerprint: str) -> str:
    return os.path.join(cache_root(), "weights", fingerprint)


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.PyTreeCheckpointer()  # synchronous: one weight's copy at a time


def restore(fingerprint: str) -> tuple[wmod.Weights, dict] | None:
    """(weights, metadata) from the cache, or None if absent or unreadable (a broken cache is removed)."""
    path = _path(fingerprint)
    if not os.path.isdir(path):
        return None
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        if meta.get("layout") != LAYOUT:
            raise ValueError(f"cache layout {meta.get('layout', 1)}, this version writes {LAYOUT}")
        ckpt = _checkpointer()
        d = {name: np.asarray(ckpt.restore(os.path.join(path, "tensors", name))["a"]) for name in meta["tensors"]}
        return wmod.from_dict(d), meta
    except Exception as e:  # a partial or incompatible cache: drop it and reload from the files
        log.warning("weight cache at %s unreadable (%s); rebuilding", path, e)
        shutil.rmtree(path, ignore_errors=True)
        return None


def save(fingerprint: str, w: wmod.Weights, meta: dict) -> None:
    """Store weights plus JSON metadata (config, tokenizer) under the fingerprint."""
    path = _path(fingerprint)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        ckpt = _checkpointer()
        arrays = wmod.to_dict(w)
        for name, arr in arrays.items():
            ckpt.save(os.path.join(tmp, "tensors", name), {"a": arr})
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "layout": LAYOUT, "tensors": sorted(arrays)}, f)
        shutil.rmtree(path, ignore_errors=True)  # another process may have just written it: same content
        os.replace(tmp, path)
    except OSError as e:  # the cache is an optimisation: never fail a load because of it
        log.warning("could not write weight cache at %s: %s", path, e)
        shutil.rmtree(tmp, ignore_errors=True)
