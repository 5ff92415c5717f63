"""A checkpoint directory's weight files: which ones, their tensor index, and the fingerprint.

Weights are `model.safetensors`, or the shards that `model.safetensors.index.json` names. A
safetensors file is an 8-byte little-endian header length, a JSON header (tensor name -> dtype,
shape, data offsets) and the data; the header is read here (cheap, no tensor library) so a
missing tensor or a truncated file is found before any data is read. A checkpoint is untrusted:
shard names may not lead outside its directory (`hf_config.checkpoint_path`), and every header
entry's shape x dtype must equal its byte range, the ranges tiling the data exactly as the
safetensors format requires, so no tensor claims more bytes than the file holds.

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
import math
import os
import struct

from pddjax.model.config import ModelConfig
from pddjax.model.fingerprint import remembered, sha256_range
from pddjax.model.hf_config import CheckpointError, checkpoint_path, read_json

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FINGERPRINT_VERSION = "pddjax-hf-1"  # bump when the conversion of tensors into Weights changes
MAX_HEADER = 100 << 20
# bytes per element of the safetensors dtypes
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


def weight_files(path: str) -> list[str]:
    """Absolute paths of the checkpoint's safetensors files, or CheckpointError."""
    index = checkpoint_path(path, INDEX)
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        bad = [k for k, v in weight_map.items() if not k or not isinstance(v, str) or not v]
        if bad:
            raise CheckpointError(f"the weight_map of {index} maps tensor {bad[0]!r} to {weight_map[bad[0]]!r}, "
                                  "not a shard file name")
        files = [checkpoint_path(path, f) for f in sorted(set(weight_map.values()))]
        for f in files:
            if not os.path.isfile(f):
                raise CheckpointError(f"shard {os.path.basename(f)} named by {index} is missing")
        return files
    single = checkpoint_path(path, SINGLE)
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
        _check_entry(path, name, t, data_size)
    covered = 0  # the format: ranges in offset order, each starting where the last ended, ending at the file's end
    for begin, end in sorted(t["data_offsets"] for t in header.values()):
        if begin != covered:
            raise CheckpointError(f"{path} is corrupt: its tensors' byte ranges overlap or leave gaps")
        covered = end
    if covered != data_size:
        raise CheckpointError(f"{path} is corrupt: {data_size - covered} bytes after its last tensor")
    return header, 8 + n


def _check_entry(path: str, name: str, t, data_size: int) -> None:
    """One header entry: a known dtype, a shape of non-negative ints, in-file offsets, shape x dtype
    bytes equal to the range."""
    def integers(v):
        return isinstance(v, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v)

    if (not isinstance(t, dict) or not isinstance(t.get("dtype"), str) or not integers(t.get("shape"))
            or not integers(t.get("data_offsets")) or len(t["data_offsets"]) != 2):
        raise CheckpointError(f"{path} is corrupt: the header entry of tensor {name} is malformed")
    if t["dtype"] not in DTYPE_BYTES:
        raise CheckpointError(f"{path} is corrupt: tensor {name} has unknown dtype {t['dtype']!r}")
    begin, end = t["data_offsets"]
    if not begin <= end <= data_size:
        raise CheckpointError(f"{path} is truncated or corrupt: tensor {name} lies past the end of the file")
    nbytes = math.prod(t["shape"]) * DTYPE_BYTES[t["dtype"]]
    if nbytes != end - begin:
        raise CheckpointError(f"{path} is corrupt: tensor {name} of shape {t['shape']} and dtype {t['dtype']} "
                              f"needs {nbytes} bytes, its header gives it {end - begin}")


def tensor_index(files: list[str]) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """tensor name -> (file, dtype, shape) over all the files."""
    out = {}
    for path in files:
        for name, t in read_header(path)[0].items():
            if name in out:
                raise CheckpointError(f"tensor {name} is in both {os.path.basename(out[name][0])} and "
                                      f"{os.path.basename(path)}")
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
