"""A GGUF file is untrusted input: its header is walked against the file's size before the `gguf`
package reads it (`gguf_check.py`: counts, string and array lengths, ranks, dims, types, tensor
offsets and sizes, overlaps), its metadata must hold positive integers within `limits.py`'s bounds,
and every tensor the metadata implies must have that shape before any is dequantized. Each
refusal is one sentence from `load_model` and one `pddjax: error:` line from the CLI, reached
without a large allocation (`refused`)."""

from __future__ import annotations

import gguf
import pytest

from tests.support.checkpoints import gguf_offset, patch_bytes, refused
from tests.support.gguf_factory import write_llama_gguf

PAST_END = "runs past the end of the file"


@pytest.fixture(scope="module")
def tiny_gguf_bytes(tiny, tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_llama_gguf(str(path), tiny.config, tiny.weights)
    return path.read_bytes()


@pytest.fixture
def hostile_gguf(tiny_gguf_bytes, tmp_path) -> str:
    """A fresh copy of the tiny model's GGUF for a test to damage."""
    path = tmp_path / "hostile.gguf"
    path.write_bytes(tiny_gguf_bytes)
    return str(path)


def data_offset(path: str, tensor: str) -> int:
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == tensor)
    return t.data_offset - reader.data_offset


@pytest.mark.timeout(30)  # the gguf package alone loops here for ~2^62 steps, growing a list
def test_array_running_past_the_end(hostile_gguf, capsys):
    at = gguf_offset(hostile_gguf, "tokenizer.ggml.token_type", 3)
    patch_bytes(hostile_gguf, at, "IQ", 0, 1 << 62)  # u8 elements, 2^62 of them
    refused(hostile_gguf, capsys, "tokenizer.ggml.token_type of 4611686018427387904 elements", PAST_END)


# (what to patch: metadata field or tensor, its part, struct format, values) -> words of the refusal
CASES = {
    "tensor count": ((None, 8, "Q", 1 << 40), ("claims 1099511627776 tensors", "more than the file can hold")),
    "metadata count": ((None, 16, "Q", 1 << 40), ("1099511627776 metadata entries",)),
    "string length": (("general.architecture", 3, "Q", 1 << 62), (PAST_END,)),
    "tensor offset": (("blk.1.ffn_down.weight", 5, "Q", 1 << 40), ("tensor blk.1.ffn_down.weight", PAST_END)),
    "dims overflow u64": (("token_embd.weight", 3, "QQ", 1 << 32, 1 << 32), ("tensor token_embd.weight", PAST_END)),
    "rank": (("blk.0.attn_q.weight", 2, "I", 5), ("rank 5",)),
    "ggml type": (("blk.0.attn_q.weight", 4, "I", 99), ("unknown GGML type 99",)),
    "metadata type": (("tokenizer.ggml.add_bos_token", 2, "I", 99), ("unknown type 99",)),
    "nested array": (("tokenizer.ggml.token_type", 3, "I", 9), ("unsupported element type 9",)),
    "float dimension": (("llama.embedding_length", 2, "I", 6), ("llama.embedding_length", "positive integer")),
    "zero heads": (("llama.attention.head_count", 3, "I", 0), ("llama.attention.head_count", "got 0")),
    "layers over the bound": (("llama.block_count", 3, "I", 2000), ("llama.block_count 2000 exceeds the supported "
                                                                    "maximum 1024",)),
    "vocab over the bound": (("llama.vocab_size", 3, "I", 1 << 23), ("llama.vocab_size 8388608 exceeds",)),
    "shape vs metadata": (("llama.feed_forward_length", 3, "I", 256),
                          ("blk.0.ffn_gate.weight has shape [128, 64], its metadata implies [256, 64]",)),
    "token not utf-8": (("tokenizer.ggml.tokens", 6, "B", 0xFF), ("tokenizer.ggml.tokens is not valid UTF-8",)),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", CASES)
def test_hostile_header(hostile_gguf, capsys, case):
    (name, part, fmt, *values), words = CASES[case]
    tensor = name is not None and not name.startswith(("general.", "llama.", "tokenizer."))
    at = part if name is None else gguf_offset(hostile_gguf, name, part, tensor=tensor)
    patch_bytes(hostile_gguf, at, fmt, *values)
    refused(hostile_gguf, capsys, *words)


def test_tensors_sharing_bytes(hostile_gguf, capsys):
    """blk.1's q weights aliasing blk.0's: the gguf package would read both from the same bytes."""
    shared = data_offset(hostile_gguf, "blk.0.attn_q.weight")
    patch_bytes(hostile_gguf, gguf_offset(hostile_gguf, "blk.1.attn_q.weight", 5, tensor=True), "Q", shared)
    refused(hostile_gguf, capsys, "overlaps the tensor before it")
