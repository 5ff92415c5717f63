"""A checkpoint directory's weight files: which ones, their tensor index, and the fingerprint.

Weights are `model.safetensors`, or the shards that `model.safetensors.index.json` names. A
safetensors file is an 8-byte little-endian header length, a JSON header (tensor name -> dtype,
shape, data offsets) and the data; the header is read here (cheap, no tensor library) so a
missing tensor or a truncated file is found before any data is read.

The fingerprint hashes what the weights *are*, not how they are stored: a version tag, the model
config (as `ModelConfig`, so a comment in config.json does not matter but head_dim or rope_theta
does) and, for every tensor in sorted name order, its name, dtype, shape and the sha256 of its
bytes. So the same checkpoint agrees from any path and however it is sharded, and different
weights or configs never agree. Per-file tensor digests are remembered by (path, size, mtime)
(`fingerprint.py`): only the first load of a file reads all of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

from pddjax.model.config import ModelConfig
from pddjax.model.fingerprint import remembered, sha256_range
from pddjax.model.hf_config import CheckpointError, read_json

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FINGERPRINT_VERSION = "pddjax-hf-1"  # bump when the conversion of tensors into Weights changes
MAX_HEADER = 100 << 20


def weight_files(path: str) -> list[str]:
    """Absolute paths of the checkpoint's safetensors files, or CheckpointError."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
        for f in files:
            if not os.path.isfile(f):
                raise CheckpointError(f"shard {os.path.basename(f)} named by {index} is missing")
        return files
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(f"{path} has no {SINGLE} or {INDEX} (only safetensors weights are supported)")


def read_header(path: str) -> tuple[dict, int]:
    """(tensor name -> {dtype, shape, data_offsets}, data start) of a safetensors file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, MAX_HEADER):
            raise CheckpointError(f"{path} is not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise CheckpointError(f"{path} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, t in header.items():
        try:
            begin, end = t["data_offsets"]
            ok = isinstance(t["dtype"], str) and all(isinstance(d, int) for d in t["shape"])
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"{path} is corrupt: the header entry of tensor {name} is malformed")
        if not 0 <= begin <= end <= data_size:
            raise CheckpointError(f"{path} is truncated or corrupt: tensor {name} lies past the end of the file")
    return header, 8 + n


def tensor_index(files: list[str]) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """tensor name -> (file, dtype, shape) over all the files."""
    out = {}
    for path in files:
        for name, t in read_header(path)[0].items():
            out[name] = (path, t["dtype"], tuple(t["shape"]))
    return out


def tensor_digests(path: str) -> dict[str, list]:
    """tensor name -> [dtype, shape, sha256 of its bytes] for one file, remembered."""

    def compute(p):
        header, start = read_header(p)
        with open(p, "rb") as f:
            return {name: [t["dtype"], t["shape"], sha256_range(f, start + t["data_offsets"][0],
                                                                start + t["data_offsets"][1])]
                    for name, t in header.items()}

    return remembered("safetensors-tensors", path, compute)


def checkpoint_fingerprint(cfg: ModelConfig, files: list[str]) -> str:
    """16 hex chars naming these weights under this config (see the module docstring)."""
    h = hashlib.sha256(FINGERPRINT_VERSION.encode())
    h.update(json.dumps({**cfg.to_json(), "name": None}, sort_keys=True).encode())
    tensors = {}
    for f in files:
        tensors.update(tensor_digests(f))
    h.update(json.dumps(sorted(tensors.items())).encode())
    return h.hexdigest()[:16]
