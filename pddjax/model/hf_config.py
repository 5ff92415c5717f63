"""A Hugging Face checkpoint directory's model config, from its `config.json` only.

Architectures: LlamaForCausalLM (Llama 2/3.x, `rope_scaling` llama3 or linear, tied or untied
embeddings), Qwen2ForCausalLM (q/k/v biases), Qwen3ForCausalLM (per-head q/k RMSNorm, explicit
`head_dim`) and MistralForCausalLM (no sliding window). Both config layouts are read: the hub's
(`rope_theta`, `rope_scaling`) and transformers 5's (`rope_parameters`). A field that would change
the math and that we do not implement is refused with one sentence naming it; fields that do not
(dropout, initializer_range, use_cache, ...) are ignored. EOS ids: the union of config.json's and
generation_config.json's `eos_token_id` (an int or a list), so stopping is the model's own.
Imports no tensor library: the router reads model facts through this.
"""

from __future__ import annotations

import json
import os

from pddjax.model.config import ModelConfig, RopeScaling

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "MistralForCausalLM": "mistral"}
MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}
# Defaults of the fields config.json may leave out, per model type (transformers' config classes).
MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "mistral": 4096 * 32}
# Fields that change the forward when set; their harmless value(s). Anything else set: refused.
REFUSED_UNLESS = {
    "attention_bias": (False, None), "mlp_bias": (False, None), "quantization_config": (None,),
    "partial_rotary_factor": (1, 1.0, None), "attn_logit_softcapping": (None,), "final_logit_softcapping": (None,),
    "query_pre_attn_scalar": (None,), "use_qk_norm": (False, None), "no_rope_layers": (None,),
}


class CheckpointError(ValueError):
    """The directory is not a checkpoint this loader can read (message is one sentence)."""


def read_json(path: str, required: bool = True) -> dict | None:
    if not os.path.isfile(path):
        if required:
            raise CheckpointError(f"{path} not found")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} as JSON: {e}") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return d


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def model_type(raw: dict, where: str) -> str:
    """The supported model type named by `architectures` (else `model_type`), or CheckpointError."""
    archs = raw.get("architectures")
    supported = ", ".join(ARCHITECTURES)
    if archs:
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise CheckpointError(f"unsupported architecture {archs} in {where} (supported: {supported})")
        return ARCHITECTURES[archs[0]]
    if raw.get("model_type") not in MODEL_TYPES:
        raise CheckpointError(f"unsupported model_type {raw.get('model_type')!r} in {where} (supported: {supported})")
    return raw["model_type"]


def _ids(value, field: str, where: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(f"{field} in {where} must be a token id or a list of them, got {value!r}")
    return values


def _rope(raw: dict, where: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from `rope_scaling` + `rope_theta` or transformers 5's `rope_parameters`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"rope_scaling in {where} must be an object, got {params!r}")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if "factor" not in params:
        raise CheckpointError(f"rope scaling of type {kind} in {where} lacks its factor")
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        try:
            return theta, RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                                      float(params["high_freq_factor"]),
                                      int(params["original_max_position_embeddings"]))
        except KeyError as e:
            raise CheckpointError(f"llama3 rope scaling in {where} lacks {e.args[0]}") from None
    raise CheckpointError(f"rope scaling of type {kind!r} in {where} is not supported (supported: default, "
                          "linear, llama3)")


def _check_window(raw: dict, mtype: str, max_context: int, where: str) -> None:
    """Full attention only: a sliding window narrower than the context is refused."""
    window = raw.get("sliding_window")
    kinds = set(raw.get("layer_types") or ())
    if kinds - {"full_attention", "sliding_attention"}:
        raise CheckpointError(f"layer_types {sorted(kinds)} in {where} are not supported (only full attention)")
    used = mtype == "mistral" or bool(raw.get("use_sliding_window")) or "sliding_attention" in kinds
    if used and window is not None and int(window) < max_context:
        raise CheckpointError(f"sliding_window {window} in {where} is not supported (only full attention: a null "
                              f"window or one of at least max_position_embeddings {max_context})")


def config_from_dir(path: str, name: str | None = None) -> ModelConfig:
    """The ModelConfig of checkpoint directory `path` (config.json + generation_config.json)."""
    where = os.path.join(path, "config.json")
    raw = read_json(where)
    mtype = model_type(raw, where)
    for field, harmless in REFUSED_UNLESS.items():
        if raw.get(field) not in harmless:
            raise CheckpointError(f"{field} = {raw[field]!r} in {where} is not supported")
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} in {where} is not supported (only silu)")

    def need(field: str) -> int:
        if not isinstance(raw.get(field), int) or raw[field] < 1:
            raise CheckpointError(f"{where} lacks a positive integer {field}")
        return raw[field]

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // heads
    max_context = int(raw.get("max_position_embeddings") or MAX_POSITIONS[mtype])
    _check_window(raw, mtype, max_context, where)
    theta, scaling = _rope(raw, where)
    gen = read_json(os.path.join(path, "generation_config.json"), required=False) or {}
    eos = sorted(set(_ids(raw.get("eos_token_id"), "eos_token_id", where))
                 | set(_ids(gen.get("eos_token_id"), "eos_token_id", "generation_config.json")))
    bos = _ids(raw.get("bos_token_id", gen.get("bos_token_id")), "bos_token_id", where)
    try:
        return ModelConfig(
            name=name or os.path.basename(os.path.normpath(path)), vocab_size=need("vocab_size"), hidden=hidden,
            num_layers=need("num_hidden_layers"), num_heads=heads, num_kv_heads=int(kv_heads),
            head_dim=int(head_dim), ffn_hidden=need("intermediate_size"), rope_base=theta,
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_context=max_context, bos_token_id=bos[0] if bos else None, eos_token_ids=tuple(eos),
            qkv_bias=mtype == "qwen2", qk_norm=mtype == "qwen3", rope_scaling=scaling)
    except ValueError as e:  # heads not a multiple of kv heads
        raise CheckpointError(f"{where}: {e}") from None
