"""`make demo`: the main job. Until the serving stack lands, it is local generation with the
real model: a short multi-turn chat through the monolithic reference engine, with timings."""

from __future__ import annotations

import time

from pddjax.model.jax_setup import configure

TURNS = [
    "What is the capital of France?",
    "Name two famous museums there.",
    "Write a haiku about the river that runs through it.",
]


def main() -> int:
    configure()
    from pddjax.engines.reference import ReferenceEngine
    from pddjax.model.registry import load_model
    from pddjax.model.sampling import SamplingParams

    model = load_model("smollm2-135m")
    print(f"loaded {model.config.name} ({model.source}) in {model.load_seconds:.1f} s")
    engine = ReferenceEngine(model.config, model.weights)
    tok, messages = model.tokenizer, []
    for user in TURNS:
        messages.append({"role": "user", "content": user})
        ids = tok.encode(tok.apply_chat_template(messages))
        print(f"\n>>> {user}\n", flush=True)
        t0, ttft, out, printed = time.perf_counter(), None, [], ""
        for t in engine.stream(ids, SamplingParams(temperature=0.0), max_tokens=64):
            ttft = ttft or time.perf_counter() - t0
            out.append(t)
            text = tok.decode(out, skip_special=True)
            if not text.endswith("\ufffd"):
                print(text[len(printed):], end="", flush=True)
                printed = text
        dt = time.perf_counter() - t0
        print(f"\n[prompt {len(ids)} tokens, TTFT {1e3 * ttft:.0f} ms, {len(out)} tokens in {dt:.2f} s]")
        messages.append({"role": "assistant", "content": tok.decode(out, skip_special=True)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
