"""Where the tests find the repository: its root, `configs/` and the test fixtures (among them the
Hugging Face checkpoints of tests/fixtures/hf/<arch>/ and transformers' answers on them)."""

from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")


def hf_fixture(arch: str) -> str:
    """The folder of the tiny Hugging Face checkpoint of `arch` (llama, qwen2, qwen3, mistral)."""
    return os.path.join(FIXTURES, "hf", arch)


def hf_reference(arch: str) -> dict:
    """transformers' outputs on that checkpoint (its reference.json)."""
    with open(os.path.join(hf_fixture(arch), "reference.json")) as f:
        return json.load(f)
