"""Orbax cache of converted weights, so a second start skips GGUF dequantization.

Layout: $PDDJAX_CACHE_DIR (default ~/.cache/pddjax)/weights/<fingerprint>/ holding an orbax
checkpoint of the flat float32 weight dict (`weights/`) and `meta.json` (config, tokenizer), so a
warm start does not even parse the GGUF's metadata. The fingerprint is the GGUF's content hash, so a
changed file never reuses a stale cache.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np

from pddjax.model import weights as wmod

log = logging.getLogger(__name__)


def cache_root() -> str:
    return os.environ.get("PDDJAX_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pddjax"))


def _path(fingerprint: str) -> str:
    return os.path.join(cache_root(), "weights", fingerprint)


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def restore(fingerprint: str) -> tuple[wmod.Weights, dict] | None:
    """(weights, metadata) from the cache, or None if absent or unreadable (a broken cache is removed)."""
    path = _path(fingerprint)
    if not os.path.isdir(path):
        return None
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        d = _checkpointer().restore(os.path.join(path, "weights"))
        return wmod.from_dict({k: np.asarray(v) for k, v in d.items()}), meta
    except Exception as e:  # a partial or incompatible cache: drop it and reload from GGUF
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
        ckpt.save(os.path.join(tmp, "weights"), wmod.to_dict(w))
        ckpt.wait_until_finished()
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        os.replace(tmp, path)
    except OSError as e:  # the cache is an optimisation: never fail a load because of it
        log.warning("could not write weight cache at %s: %s", path, e)
        shutil.rmtree(tmp, ignore_errors=True)
