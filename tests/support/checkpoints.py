"""Hostile checkpoints for the loader's refusals: copies of the tiny HF fixtures with a config,
an index or a safetensors header rewritten, GGUF bytes patched in place, and `refused`, which
asserts the one-sentence refusal of `load_model` and of `pddjax generate --model`."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tracemalloc

import pytest

from pddjax.model.gguf_meta import GGUFError
from pddjax.model.registry import CheckpointError, ModelNotFound, load_model
from serving.cli import main
from tests.support.paths import hf_fixture

ALLOCATION_CEILING = 64 << 20  # bytes: a refusal may not allocate more (the fixtures are < 1 MB)


def copy_fixture(tmp_path, arch: str) -> str:
    dst = str(tmp_path / arch)
    shutil.copytree(hf_fixture(arch), dst)
    return dst


def edit_config(path: str, **changes) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def read_safetensors(file: str) -> tuple[dict, bytes]:
    """(header as a dict, the data bytes) of a safetensors file, read raw."""
    with open(file, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), f.read()


def write_safetensors(file: str, header: dict, data: bytes) -> None:
    """Write `header` and `data` as they are: no check that they agree."""
    text = json.dumps(header).encode()
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def edit_header(file: str, edit) -> None:
    header, data = read_safetensors(file)
    data = edit(header, data) or data
    write_safetensors(file, header, data)


def one_sentence(msg: str) -> bool:
    return "\n" not in msg and "Traceback" not in msg and len(re.findall(r"[.!?]\s", msg + " ")) <= 1


def refused(path: str, capsys, *words: str) -> str:
    """load_model refuses `path` with one sentence holding `words`, allocating under
    ALLOCATION_CEILING on the way, and the CLI exits 2 saying exactly that sentence on one line."""
    tracemalloc.start()
    try:
        with pytest.raises((CheckpointError, ModelNotFound, GGUFError)) as e:
            load_model(path, use_cache=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < ALLOCATION_CEILING, f"{peak} bytes allocated before the refusal"
    msg = str(e.value)
    assert one_sentence(msg), msg
    for w in words:
        assert w in msg, msg
    capsys.readouterr()
    rc = main(["generate", "--model", path, "--prompt-ids", "1,2", "--max-tokens", "1", "--json"])
    out = capsys.readouterr()
    assert rc == 2 and out.err.strip() == f"pddjax: error: {msg}" and not out.out, out
    assert len(out.err.strip().splitlines()) == 1
    return msg


def gguf_offset(path: str, name: str, part: int, tensor: bool = False) -> int:
    """Byte offset in the GGUF at `path` of part `part` of metadata field `name` (parts: key length,
    key, type, then the value: a scalar; a string's length and bytes; an array's element type, length,
    elements), or with `tensor` of tensor `name`'s info (name length, name, rank, dims, type, offset)."""
    import gguf

    reader = gguf.GGUFReader(path)
    fld = next(t.field for t in reader.tensors if t.name == name) if tensor else reader.fields[name]
    return int(fld.parts[part].ctypes.data - reader.data.ctypes.data)


def patch_bytes(path: str, offset: int, fmt: str, *values) -> None:
    """Overwrite the bytes at `offset` with struct.pack("<" + fmt, *values)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<" + fmt, *values))
