"""Bounds on a checkpoint's model dimensions, so a config.json or GGUF header cannot ask for a
10^12-element tensor (or a router to accept a context of 10^15 tokens) before anything is read.

Each bound is far above any released dense model (Llama 3.1 405B: hidden 16384, 126 layers, 128
heads, head_dim 128, intermediate 53248, vocabulary 128256; Gemma: vocabulary 262144, head_dim
256) yet finite; the parameter count of the whole config is bounded too (2 * 10^12, so a dense
1T-parameter model fits and the per-dimension maxima cannot all be combined). No imports beyond
the config: both checkpoint readers (`hf_config`, `gguf_meta`) and the router use it.
"""

from __future__ import annotations

from pddjax.model.config import ModelConfig

# ModelConfig field -> largest accepted value
LIMITS = {
    "vocab_size": 1 << 22,  # 4,194,304 tokens
    "hidden": 1 << 16,  # 65,536
    "num_layers": 1 << 10,  # 1,024
    "num_heads": 1 << 10,
    "num_kv_heads": 1 << 10,
    "head_dim": 1 << 10,
    "ffn_hidden": 1 << 19,  # 524,288
    "max_context": 1 << 24,  # 16,777,216 positions
}
MAX_PARAMETERS = 2 * 10**12


def parameter_count(cfg: ModelConfig) -> int:
    """Weights the config implies (matrices, biases and norms), exact for our Weights layout."""
    E, H, K, D, F, V = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_hidden, cfg.vocab_size
    per_layer = 2 * E + 2 * E * H * D + 2 * E * K * D + 3 * E * F
    per_layer += (H + 2 * K) * D if cfg.qkv_bias else 0
    per_layer += 2 * D if cfg.qk_norm else 0
    return V * E * (1 if cfg.tie_embeddings else 2) + E + cfg.num_layers * per_layer


def limits_problem(cfg: ModelConfig, names: dict[str, str]) -> str | None:
    """A sentence naming the first dimension over its bound (as the checkpoint spells it, via
    `names`: our field -> the source's key), or the parameter count over MAX_PARAMETERS; None if fine."""
    for fld, limit in LIMITS.items():
        value = getattr(cfg, fld)
        if value > limit:
            return f"{names.get(fld, fld)} {value} exceeds the supported maximum {limit}"
    n = parameter_count(cfg)
    if n > MAX_PARAMETERS:
        return f"the config implies {n:.3g} parameters, more than the supported maximum {MAX_PARAMETERS:.0e}"
    return None
