"""Model profiles: the few numbers of a transformer that set prefill, decode and KV cost.

- matmul FLOPs per token = 2 * active_params (MoE: only the routed experts compute);
- attention FLOPs per (query, key) pair = 4 * layers * n_heads * head_dim (QK^T and PV);
- KV bytes per token: what one token's cache costs in memory and on the wire;
- parameter bytes: what every forward pass reads (we assume all experts are touched at
  serving batch sizes, which is conservative for small batches).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelProfile:
    name: str
    layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    kv_bytes_per_token: float
    param_bytes: float
    active_params: float  # parameters used per token (= all of them for a dense model)
    attn_keys: int | None = None  # sparse attention: keys each query attends (None = all)

    @property
    def flops_per_token(self) -> float:
        """Matmul FLOPs per processed token."""
        return 2.0 * self.active_params

    @property
    def attn_flops_per_pair(self) -> float:
        """Attention FLOPs per (query token, cached key token) pair."""
        return 4.0 * self.layers * self.n_heads * self.head_dim


def attn_pairs(model: ModelProfile, cached: float, new: float) -> float:
    """(query, key) pairs when `new` tokens attend after `cached` ones (causal)."""
    k = model.attn_keys
    dense = cached * new + new * new / 2
    if k is None:
        return dense
    if cached >= k:
        return k * new
    ramp = min(new, k - cached)  # queries that still see fewer than k keys
    return cached * ramp + ramp * ramp / 2 + k * (new - ramp)


def gqa_kv_bytes(layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """KV bytes per token of a grouped-query-attention model: 2 (K, V) * L * H_kv * D * bytes."""
    return 2 * layers * n_kv_heads * head_dim * dtype_bytes


MODELS: dict[str, ModelProfile] = {
    # A flagship MoE with the report's typical ~50 KB/token of KV. Shape after DeepSeek-V2
    # (236B total, 21B active, 60 layers, 128 heads; MLA heads have qk dim 192 and v dim 128,
    # 160 is their mean for attention FLOPs), weights in FP8; the 50 KB/token is the report's
    # figure (its 100-token handoff is 4,649 KB: 46.5 KB/token).
    "flagship-50k": ModelProfile(
        name="flagship-50k", layers=60, n_heads=128, n_kv_heads=1, head_dim=160, hidden=5120,
        kv_bytes_per_token=50_000, param_bytes=236e9, active_params=21e9,
    ),
    # The same flagship with DeepSeek-V3.2-style sparse attention (each query attends its top
    # 2,048 keys; the cheap indexer over all keys is ignored): long-context prefill becomes
    # roughly linear in new tokens. A sensitivity case, not the report's model.
    "flagship-50k-sparse": ModelProfile(
        name="flagship-50k-sparse", layers=60, n_heads=128, n_kv_heads=1, head_dim=160, hidden=5120,
        kv_bytes_per_token=50_000, param_bytes=236e9, active_params=21e9, attn_keys=2048,
    ),
    # SmolLM2-135M (HF config): 30 layers, 9 heads, 3 KV heads, head dim 64, hidden 576,
    # ~134.5M parameters in BF16; KV = 2*30*3*64*2 = 23,040 bytes/token.
    "smollm2-135m": ModelProfile(
        name="smollm2-135m", layers=30, n_heads=9, n_kv_heads=3, head_dim=64, hidden=576,
        kv_bytes_per_token=gqa_kv_bytes(30, 3, 64), param_bytes=2 * 134.5e6, active_params=134.5e6,
    ),
}


def get_model(name: str) -> ModelProfile:
    """Look up a preset by name; KeyError names the choices."""
    key = name.lower()
    if key not in MODELS:
        raise KeyError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return MODELS[key]
