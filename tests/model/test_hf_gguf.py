"""GGUF files of the qwen2 and qwen3 architectures, written from the HF fixtures the way llama.cpp's
converter lays them out (HF tensors renamed, q/k not permuted for these architectures, a byte-level
BPE vocabulary with pre-tokenizer `qwen2`, padded to the model's vocab with [PAD] tokens): logits
within 1e-4 of transformers' on the same weights, and the GGUF-built tokenizer and chat template
give transformers' ids. A Llama 3.1 GGUF (rope_freqs.weight) is refused with one sentence."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from pddjax.model import weights as wmod
from pddjax.model.dense import forward_full
from pddjax.model.gguf_meta import GGUFError
from pddjax.model.hf_config import config_from_dir
from pddjax.model.hf_tokenizer import HFTokenizer
from pddjax.model.registry import load_model
from tests.support.paths import FIXTURES

LOGIT_TOL = 1e-4
NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
         "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
for _p in "qkv":
    NAMES[f"self_attn.{_p}_proj.weight"] = f"attn_{_p}.weight"
    NAMES[f"self_attn.{_p}_proj.bias"] = f"attn_{_p}.bias"
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in TOP:
        return TOP[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{NAMES[rest]}"


def hf_tensors(d: str) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def write_gguf(path: str, d: str, arch: str, extra: dict | None = None) -> None:
    """Checkpoint directory `d` as a GGUF of architecture `arch` (float32 tensors)."""
    import gguf

    cfg, tok = config_from_dir(d), HFTokenizer.from_dir(d)
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        template = json.load(f).get("chat_template")
    if os.path.isfile(os.path.join(d, "chat_template.jinja")):
        with open(os.path.join(d, "chat_template.jinja")) as f:
            template = f.read()
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_context)
    w.add_embedding_length(cfg.hidden)
    w.add_feed_forward_length(cfg.ffn_hidden)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_vocab_size(cfg.vocab_size)
    n = tok.vocab_size
    added = tok.tok.get_added_tokens_decoder()
    tokens = [tok.tok.id_to_token(i) for i in range(n)] + [f"[PAD{i}]" for i in range(n, cfg.vocab_size)]
    types = [(3 if added[i].special else 4) if i in added else 1 for i in range(n)] + [5] * (cfg.vocab_size - n)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) for m in json.loads(tok.tok.to_str())["model"]["merges"]])
    w.add_eos_token_id(cfg.eos_token_ids[0])
    w.add_add_bos_token(False)
    w.add_chat_template(template)
    for name, arr in {**hf_tensors(d), **(extra or {})}.items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        w.add_tensor(name if name.startswith("rope_freqs") else gguf_name(name), np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_gguf_matches_transformers(tmp_path, arch):
    d = os.path.join(FIXTURES, "hf", arch)
    with open(os.path.join(d, "reference.json")) as f:
        ref = json.load(f)
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(path, d, arch)
    m = load_model(path, use_cache=False)
    hf = config_from_dir(d)
    assert (m.config.qkv_bias, m.config.qk_norm, m.config.head_dim, m.config.tie_embeddings) == \
        (hf.qkv_bias, hf.qk_norm, hf.head_dim, hf.tie_embeddings)
    w = wmod.cast(m.weights, jnp.float32)
    for p in ref["prompts"]:
        logits = np.asarray(forward_full(w, m.config, jnp.asarray([p["prompt_ids"] + p["greedy"][:-1]])))[0]
        k = len(p["prompt_ids"])
        np.testing.assert_allclose(logits[k - 1], p["logits_last_prompt"], rtol=0, atol=LOGIT_TOL)
        np.testing.assert_allclose(logits[-1], p["logits_last"], rtol=0, atol=LOGIT_TOL)
        assert logits[k - 1:].argmax(-1).tolist() == p["greedy"]
    tok = m.tokenizer
    for case in ref["tokenizer"]:
        assert tok.encode(case["text"]) == case["ids_no_special"], case["text"]
    assert tok.apply_chat_template(ref["chat"]["messages"]) == ref["chat"]["text"]
    assert tok.encode_chat(ref["chat"]["messages"]) == ref["chat"]["ids"]


def test_llama31_rope_factors_are_refused(tmp_path):
    path = str(tmp_path / "llama31.gguf")
    factors = np.ones(8, np.float32)  # [D/2]
    write_gguf(path, os.path.join(FIXTURES, "hf", "qwen2"), "llama", {"rope_freqs.weight": factors})
    with pytest.raises(GGUFError) as e:
        load_model(path, use_cache=False)
    assert "rope_freqs.weight" in str(e.value) and "\n" not in str(e.value)
