"""`make demo`: the main job. Starts the whole PDD stack with `pddjax up` (P and RLD in
cluster A, MD in cluster B behind a slowed WAN link, the router), then plays a short multi-turn
chat with the real SmolLM2-135M-Instruct through the router's streaming Generate. Per turn it
shows the pipeline the router chose and why, TTFT, which tokens RLD (relay) and MD (main)
produced, how much of the prompt MD's DRC already held and the KV bytes that crossed the WAN."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

TURNS = [
    "What is the capital of France?",
    "Name two famous museums there.",
    "Write a haiku about the river that runs through it.",
]
WAN = ["--wan-mbps", "100", "--wan-latency-ms", "20"]


def start_stack(state: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "pddjax", "up", "--port", "0", "--state", state, *WAN],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while not os.path.exists(state):
        if proc.poll() is not None:
            raise SystemExit(f"pddjax up failed:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit("pddjax up did not start within 10 minutes")
        time.sleep(0.2)
    return proc


def main() -> int:
    from pddjax.model.meta import model_facts
    from serving.client import Client, make_request

    cfg, tok = model_facts("smollm2-135m")  # tokenizer only: shows which text each tier made

    state = os.path.join(tempfile.mkdtemp(prefix="pddjax-demo-"), "state.json")
    print("starting the stack: pddjax up " + " ".join(WAN) + " (P, RLD, MD, router; real model) ...", flush=True)
    t0 = time.perf_counter()
    proc = start_stack(state)
    try:
        with open(state) as f:
            st = json.load(f)
        print(f"up in {time.perf_counter() - t0:.0f} s: router {st['router']}, MD behind the WAN link "
              f"{st['wan']['address']} ({st['wan']['mbps']:.0f} Mb/s, {st['wan']['latency_ms']:.0f} ms)")
        client, messages = Client(st["router"]), []
        print("warming up (the first requests compile the engines' shapes) ...", flush=True)
        for warm in ("Hello!", "Tell me something about rivers, in one sentence."):
            client.generate(make_request(chat=[{"role": "user", "content": warm}], max_tokens=16, pipeline="pdd"),
                            timeout=600)
        for user in TURNS:
            messages.append({"role": "user", "content": user})
            print(f"\n>>> {user}\n", flush=True)
            r = client.generate(make_request(chat=messages, max_tokens=48, pipeline="auto"), timeout=600,
                                on_tokens=lambda m: print(m.text, end="", flush=True))
            u, t = r.usage, r.timings
            relay = tok.decode(r.token_ids[:u["relay_tokens"]], skip_special=True) if u["relay_tokens"] else ""
            print(f"\n[{r.pipeline}: {r.explain}]")
            print(f"[TTFT {r.ttft_ms:.0f} ms, {len(r.token_ids)} tokens in {r.total_ms / 1e3:.2f} s; "
                  f"relay (RLD) {u['relay_tokens']} tokens, main (MD) {u['main_tokens']} tokens"
                  + (f", handed off at token {t['handoff_position']}" if u["handoff_tokens"] else "") + "]")
            if relay:
                print(f"[from RLD: {relay!r}]")
            print(f"[prompt {u['prompt_tokens']} tokens: P had {u['cached_on_prefill']} cached, MD's DRC "
                  f"{u['cached_on_main']}; KV over the WAN {u['kv_bytes_to_main'] / 1e6:.2f} MB "
                  f"of {u['prompt_tokens'] * cfg.kv_bytes_per_token / 1e6:.2f} MB for the whole prompt]")
            messages.append({"role": "assistant", "content": r.text})
        client.close()
        return 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    raise SystemExit(main())
