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
import math
import os

from pddjax.model.config import ModelConfig, RopeScaling
from pddjax.model.limits import limits_problem

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
# ModelConfig field -> config.json key, for the bounds' refusals (`limits.py`)
HF_NAMES = {"vocab_size": "vocab_size", "hidden": "hidden_size", "num_layers": "num_hidden_layers",
            "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
            "ffn_hidden": "intermediate_size", "max_context": "max_position_embeddings"}


class CheckpointError(ValueError):
    """The directory is not a checkpoint this loader can read (message is one sentence)."""


def checkpoint_path(path: str, name: str) -> str:
    """os.path.join(path, name), refused when it resolves (through `..`, an absolute name or a
    symlink) outside the directory. A Hugging Face hub snapshot (`.../snapshots/<rev>`) may also
    link into its repository's `blobs/`, where the hub keeps the files."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"checkpoint {path} names a file {name!r}, which is not a file name")
    root = os.path.realpath(path)
    roots = [root]
    if os.path.basename(os.path.dirname(root)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
    real = os.path.realpath(os.path.join(root, name))
    if not any(real == r or real.startswith(r + os.sep) for r in roots):
        raise CheckpointError(f"file {name} of checkpoint {path} resolves to {real}, outside the checkpoint directory")
    return os.path.join(path, name)


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


def _integer(raw: dict, field: str, where: str, default: int | None = None) -> int:
    """A positive integer field (`default` when absent or null; required when there is none)."""
    value = raw.get(field)
    if value is None and default is not None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{where} lacks a positive integer {field}" if value is None else
                              f"{field} in {where} must be a positive integer, got {value!r}")
    return value


def _number(raw: dict, field: str, where: str, default: float) -> float:
    """A positive finite number field (`default` when absent)."""
    value = raw.get(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise CheckpointError(f"{field} in {where} must be a positive number, got {value!r}")
    return float(value)


def _rope(raw: dict, where: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from `rope_scaling` + `rope_theta` or transformers 5's `rope_parameters`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"rope_scaling in {where} must be an object, got {params!r}")
    theta = _number(params, "rope_theta", where, _number(raw, "rope_theta", where, 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if "factor" not in params:
        raise CheckpointError(f"rope scaling of type {kind} in {where} lacks its factor")
    if kind == "linear":
        return theta, RopeScaling("linear", _number(params, "factor", where, 1.0))
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise CheckpointError(f"llama3 rope scaling in {where} lacks {key}")
        return theta, RopeScaling("llama3", _number(params, "factor", where, 1.0),
                                  _number(params, "low_freq_factor", where, 1.0),
                                  _number(params, "high_freq_factor", where, 4.0),
                                  _integer(params, "original_max_position_embeddings", where))
    raise CheckpointError(f"rope scaling of type {kind!r} in {where} is not supported (supported: default, "
                          "linear, llama3)")


def _check_window(raw: dict, mtype: str, max_context: int, where: str) -> None:
    """Full attention only: a sliding window narrower than the context is refused."""
    window = raw.get("sliding_window")
    kinds = set(raw.get("layer_types") or ())
    if kinds - {"full_attention", "sliding_attention"}:
        raise CheckpointError(f"layer_types {sorted(kinds)} in {where} are not supported (only full attention)")
    used = mtype == "mistral" or bool(raw.get("use_sliding_window")) or "sliding_attention" in kinds
    if window is not None:
        window = _integer(raw, "sliding_window", where)
    if used and window is not None and window < max_context:
        raise CheckpointError(f"sliding_window {window} in {where} is not supported (only full attention: a null "
                              f"window or one of at least max_position_embeddings {max_context})")


def config_from_dir(path: str, name: str | None = None) -> ModelConfig:
    """The ModelConfig of checkpoint directory `path` (config.json + generation_config.json)."""
    where = checkpoint_path(path, "config.json")
    raw = read_json(where)
    mtype = model_type(raw, where)
    for field, harmless in REFUSED_UNLESS.items():
        if raw.get(field) not in harmless:
            raise CheckpointError(f"{field} = {raw[field]!r} in {where} is not supported")
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} in {where} is not supported (only silu)")

    def need(field: str) -> int:
        return _integer(raw, field, where)

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv_heads = _integer(raw, "num_key_value_heads", where, heads)
    if raw.get("head_dim") is None and hidden < heads:
        raise CheckpointError(f"hidden_size {hidden} in {where} is smaller than num_attention_heads {heads}")
    head_dim = _integer(raw, "head_dim", where, hidden // heads)
    max_context = _integer(raw, "max_position_embeddings", where, MAX_POSITIONS[mtype])
    _check_window(raw, mtype, max_context, where)
    theta, scaling = _rope(raw, where)
    gen = read_json(checkpoint_path(path, "generation_config.json"), required=False) or {}
    eos = sorted(set(_ids(raw.get("eos_token_id"), "eos_token_id", where))
                 | set(_ids(gen.get("eos_token_id"), "eos_token_id", "generation_config.json")))
    bos = _ids(raw.get("bos_token_id", gen.get("bos_token_id")), "bos_token_id", where)
    try:
        cfg = ModelConfig(
            name=name or os.path.basename(os.path.normpath(path)), vocab_size=need("vocab_size"), hidden=hidden,
            num_layers=need("num_hidden_layers"), num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim, ffn_hidden=need("intermediate_size"), rope_base=theta,
            rms_eps=_number(raw, "rms_norm_eps", where, 1e-6),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_context=max_context, bos_token_id=bos[0] if bos else None, eos_token_ids=tuple(eos),
            qkv_bias=mtype == "qwen2", qk_norm=mtype == "qwen3", rope_scaling=scaling)
    except ValueError as e:  # heads not a multiple of kv heads
        raise CheckpointError(f"{where}: {e}") from None
    problem = limits_problem(cfg, HF_NAMES)
    if problem:
        raise CheckpointError(f"{problem} in {where}")
    return cfg
