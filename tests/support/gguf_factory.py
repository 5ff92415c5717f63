"""Write small Llama-family GGUF files the way llama.cpp's converter does (Q/K rows permuted
for RoPE, quantized tensors), so the loader is tested on files we fully control."""

from __future__ import annotations

import numpy as np

from pddjax.model.config import ModelConfig
from pddjax.model.weights import Weights


def _bytes_to_unicode() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to q/k weights ([n*D, E], rows = outputs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """Three control tokens, the 256 byte-level symbols, a few merges, then unused fillers."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_syms = _bytes_to_unicode()
    merges = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = specials + byte_syms + merged
    types = [3] * 3 + [1] * (len(tokens) - 3)
    while len(tokens) < size:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(5)
    return tokens, types, merges


def write_llama_gguf(path: str, cfg: ModelConfig, w: Weights, qtypes: dict[str, str] | None = None) -> None:
    """qtypes maps tensor kinds ("embed", "q", "k", "v", "o", "gate", "up", "down") to GGML type names."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    qtypes = qtypes or {}
    wr = gguf.GGUFWriter(path, "llama")
    wr.add_block_count(cfg.num_layers)
    wr.add_context_length(cfg.max_context)
    wr.add_embedding_length(cfg.hidden)
    wr.add_feed_forward_length(cfg.ffn_hidden)
    wr.add_head_count(cfg.num_heads)
    wr.add_head_count_kv(cfg.num_kv_heads)
    wr.add_rope_freq_base(cfg.rope_base)
    wr.add_layer_norm_rms_eps(cfg.rms_eps)
    wr.add_rope_dimension_count(cfg.head_dim)
    wr.add_vocab_size(cfg.vocab_size)
    tokens, types, merges = vocab(cfg.vocab_size)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("smollm")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_add_bos_token(False)

    def put(name, arr, kind=None):
        arr = np.ascontiguousarray(arr, np.float32)
        qt = Q[qtypes.get(kind, "F32")]
        if qt == Q.F32:
            wr.add_tensor(name, arr)
        elif qt == Q.F16:
            wr.add_tensor(name, arr.astype(np.float16))
        else:
            wr.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)

    E, H, K, D = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lw = w.layers
    put("token_embd.weight", w.embed, "embed")
    put("output_norm.weight", w.final_norm)
    if w.lm_head is not None:
        put("output.weight", np.asarray(w.lm_head).T, "embed")
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        put(b + "attn_norm.weight", lw.attn_norm[i])
        put(b + "attn_q.weight", permute_qk(np.asarray(lw.wq[i]).reshape(E, H * D).T, H), "q")
        put(b + "attn_k.weight", permute_qk(np.asarray(lw.wk[i]).reshape(E, K * D).T, K), "k")
        put(b + "attn_v.weight", np.asarray(lw.wv[i]).reshape(E, K * D).T, "v")
        put(b + "attn_output.weight", np.asarray(lw.wo[i]).reshape(H * D, E).T, "o")
        put(b + "ffn_norm.weight", lw.mlp_norm[i])
        put(b + "ffn_gate.weight", np.asarray(lw.w_gate[i]).T, "gate")
        put(b + "ffn_up.weight", np.asarray(lw.w_up[i]).T, "up")
        put(b + "ffn_down.weight", np.asarray(lw.w_down[i]).T, "down")
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
