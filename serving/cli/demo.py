"""`make demo`: the main job. Starts the whole PDD stack with `pddjax up` (P and RLD in
cluster A, MD in cluster B behind a 100 Mb/s, 20 ms WAN link, the router), then plays a short
multi-turn chat with the real SmolLM2-135M-Instruct through the router's streaming Generate.

Turn 1 hands the model a long document (a lighthouse logbook generated here, deterministically:
a ~1,300-token prompt whose KV, 46,080 B/token, is ~60 MB, ~5 s on the line) that MD has never seen: the
router's `auto` sends it P-RLD-MD (pdd), RLD answers at once from cluster A while the KV crosses
the WAN, then hands MD only the token IDs it produced. The demo prints where RLD handed over,
what crossed the WAN (KV bytes against the handoff's token-ID bytes) and the gap the user saw at
the switch. Turns 2 and 3 ask about it: MD's DRC holds the context, so they go P-MD (pd-cross).
Per turn: the pipeline and the router's reason, TTFT, which tokens RLD (relay) and MD (main)
produced, how much of the prompt P and MD's DRC already held and the KV bytes that crossed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

WAN = ["--wan-mbps", "100", "--wan-latency-ms", "20"]
# The longest turn holds ~1,600 tokens: the stack serves at most 2,048 a request (the model's own
# context is 8,192), so every engine's page tables stop at 128 pages: its first steps, padded to
# the widest table until their own shapes are built, cost a quarter, and fewer shapes are built
CONTEXT = ["--max-context", "2048"]
DOC_ENTRIES = 22  # ~1,300 prompt tokens: the transfer (~5 s at 100 Mb/s) outlasts RLD's first tokens
DOC_QUESTION = "Summarize the logbook above: for each entry, name the keeper, the lighthouse and what they did."
DOC_MAX_TOKENS = 160  # RLD decodes ~10-20 tok/s here: the handoff comes well before the answer ends
FIRST_TURN = "Hello! Who are you?"  # a short turn the moment the stack serves, before the warm-up
TURNS = ["Which keeper rescued a fishing crew, and at which lighthouse?",
         "Write a haiku about that lighthouse."]
TURN_MAX_TOKENS = 48

KEEPERS = ["Ada Lind", "Tomas Reyes", "Mira Okafor", "Jonas Berg", "Lena Duval", "Oskar Haas", "Nadia Petrov",
           "Iris Calder", "Felix Moreau", "Hana Sato", "Pavel Novak", "Rosa Almeida"]
LIGHTS = ["Cape Morrow", "Gull Point", "Iron Rock", "North Sound", "Saltmarsh Head", "Black Reef", "Fairhaven",
          "Storm Bay", "Widow's Spit", "Copper Isle", "Lantern Key", "Greywater"]
WINDS = ["north", "north-east", "east", "south-east", "south", "south-west", "west", "north-west"]
EVENTS = ["replaced {n} lamp wicks", "repainted the gallery rail", "logged {n} ships passing at night",
          "rescued a fishing crew of {n}", "repaired the fog bell", "cleaned {n} lens panels",
          "received {n} barrels of oil", "reported ice on the stairs", "trained {n} new assistants"]


def document(entries: int = DOC_ENTRIES, year: int = 1911) -> str:
    """A logbook of `entries` entries, the same on every machine (no randomness); another
    `year` gives a different text of the same shape (the warm-up's)."""
    s = year % 12
    lines = [f"Coastal Lighthouse Service: logbook summary for {year}", ""]
    for k in range(entries):
        keeper, light = KEEPERS[(k + s) % 12], LIGHTS[(5 * k + 3 + s) % 12]
        wind, n = WINDS[(3 * k + 1 + s) % 8], 2 + (7 * k + s) % 11
        a, b = EVENTS[(k + s) % 9].format(n=n), EVENTS[(4 * k + 2 + s) % 9].format(n=n + 3)
        lines.append(f"Entry {k + 1}. On day {12 + 13 * k} the keeper {keeper} at {light} lighthouse {a} and {b}. "
                     f"Wind from the {wind} at {8 + (5 * k) % 23} knots, visibility {1 + k % 9} miles, "
                     f"sea state {1 + (k * 5) % 7}.")
    return "\n".join(lines)


def doc_message(year: int = 1911) -> str:
    return f"Here is a logbook.\n\n{document(year=year)}\n\n{DOC_QUESTION}"


def start_stack(state: str) -> subprocess.Popen:
    from pddjax.env import READY_SECONDS

    wait_s = READY_SECONDS.get() + 120  # pddjax up waits READY_SECONDS for its services
    proc = subprocess.Popen([sys.executable, "-m", "serving", "up", "--port", "0", "--state", state, *WAN, *CONTEXT],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def relay_progress() -> None:  # up's own progress lines as they come; the pipe drained for good
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("pddjax up:") and not os.path.exists(state):
                print("  " + line.rstrip(), flush=True)

    reader = threading.Thread(target=relay_progress, daemon=True)
    reader.start()
    deadline = time.monotonic() + wait_s
    while not os.path.exists(state):
        if proc.poll() is not None:
            reader.join(5)
            raise SystemExit("pddjax up failed:\n" + "".join(lines))
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit(f"pddjax up did not start within {wait_s:.0f} s")
        time.sleep(0.2)
    return proc


def auto_would_pick(client, cfg, prompt_tokens: int, max_tokens: int):
    """What the router's auto policy would choose for a cold prompt now, from its own estimates
    (Stats: the measured link, RLD's measured speed): the demo asks for pdd explicitly only if
    auto would not choose it (e.g. RLD measured so fast it would finish before the KV lands)."""
    from pddjax.policy import Inputs, PolicyConfig, decide
    from serving.pb import router_pb2

    st = json.loads(client.stub.Stats(router_pb2.StatsRequest(), metadata=client.metadata).json)
    link = next(iter(st.get("links", {}).values()), {"mbps": 100.0, "latency_ms": 20.0, "queued_bytes": 0})
    rld = next(iter(st.get("rld_tokens_per_s", {}).values()), 50.0)
    i = Inputs(prompt_tokens=prompt_tokens, max_tokens=max_tokens, hit_prefill=0, hit_main=0,
               kv_bytes_per_token=cfg.kv_bytes_per_token, wan_bytes_per_s=link["mbps"] * 1e6 / 8,
               wan_latency_s=link["latency_ms"] / 1e3, wan_queue_bytes=int(link.get("queued_bytes", 0)),
               relay_tokens_per_s=rld)
    return decide(i, PolicyConfig()), i


def handoff_bytes(ids: list[int], chunks: int) -> int:
    """The token-ID handoff's protobuf payload (HandoffTokensRequest messages, `chunks` of them,
    the ids split evenly); gRPC / HTTP/2 framing (~30-50 B a message) not counted."""
    from serving.pb import cluster_pb2

    chunks, total, start = max(1, chunks), 0, 0
    for c in range(chunks):
        end = len(ids) * (c + 1) // chunks
        total += cluster_pb2.HandoffTokensRequest(request_id="chat-1", start_position=start, token_ids=ids[start:end],
                                                  final=c == chunks - 1, chunk_seq=c).ByteSize()
        start = end
    return total


def turn(client, tok, cfg, messages: list[dict], max_tokens: int, pipeline: str):
    """One streamed turn; prints the text as it comes, marking where RLD handed over to MD."""
    from serving.client import make_request
    from serving.pb import common_pb2

    times: list[tuple[float, int, int]] = []  # (t, tokens, source) per stream message

    def show(m):
        src = m.sources[0] if m.sources else 0
        if times and times[-1][2] == common_pb2.ROLE_RELAY and src == common_pb2.ROLE_MAIN:
            print(" [RLD -> MD] ", end="")
        times.append((time.perf_counter(), len(m.token_ids), src))
        print(m.text, end="", flush=True)

    sent = time.perf_counter()
    r = client.generate(make_request(chat=messages, max_tokens=max_tokens, pipeline=pipeline), timeout=600,
                        on_tokens=show)
    u, t = r.usage, r.timings
    relay = tok.decode(r.token_ids[:u["relay_tokens"]], skip_special=True) if u["relay_tokens"] else ""
    print(f"\n[{r.pipeline}: {r.explain}]")
    print(f"[TTFT {r.ttft_ms:.0f} ms, {len(r.token_ids)} tokens in {r.total_ms / 1e3:.2f} s; "
          f"relay (RLD) {u['relay_tokens']} tokens, main (MD) {u['main_tokens']} tokens]")
    if relay:
        print(f"[from RLD: {relay!r}]")
    relay_t = [tm for tm, _, s in times if s == common_pb2.ROLE_RELAY]
    main_t = [tm for tm, _, s in times if s == common_pb2.ROLE_MAIN]
    if u["relay_tokens"] and u["main_tokens"] and relay_t and main_t:
        gaps = sorted(1e3 * (b[0] - a[0]) / b[1] for a, b in zip(times, times[1:]))
        print(f"[handover: RLD streamed tokens 1-{u['relay_tokens']} (the last at {relay_t[-1] - sent:.2f} s), "
              f"MD from token {t['handoff_position'] + 1} (the first at {main_t[0] - sent:.2f} s): "
              f"gap at the switch {1e3 * (main_t[0] - relay_t[-1]):.0f} ms "
              f"(median gap between tokens {gaps[len(gaps) // 2]:.0f} ms)]")
        kv, ids = u["kv_bytes_to_main"], handoff_bytes(r.token_ids[:u["handoff_tokens"]], u["handoff_chunks"])
        msgs = f"{u['handoff_chunks']} message" + ("s" if u["handoff_chunks"] != 1 else "")
        print(f"[over the WAN: KV {kv / 1e6:.2f} MB ({kv // cfg.kv_bytes_per_token} prompt tokens MD lacked; P's push "
              f"took {1e-3 * t['kv_to_main_ms']:.1f} s) vs token IDs {ids} B ({u['handoff_tokens']} ids in {msgs}: "
              f"the protobuf payload, gRPC framing not counted): {kv / max(ids, 1):,.0f}x fewer bytes]")
    elif r.pipeline == "pdd":
        print("[RLD finished the answer before MD held the KV: no handover]")
    print(f"[prompt {u['prompt_tokens']} tokens: P had {u['cached_on_prefill']} cached, MD's DRC "
          f"{u['cached_on_main']}; KV over the WAN {u['kv_bytes_to_main'] / 1e6:.2f} MB "
          f"of {u['prompt_tokens'] * cfg.kv_bytes_per_token / 1e6:.2f} MB for the whole prompt]")
    return r


def curl_line(base_url: str, model: str = "smollm2-135m") -> str:
    """A `curl` a user can paste: one streamed chat turn through the gateway (serving/openai)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Name three lighthouses."}],
                       "max_tokens": 48, "stream": True})
    from pddjax.env import ROUTER_TOKEN_FILE

    token_file = ROUTER_TOKEN_FILE.get()  # the router's bearer token is the API key
    auth = f' -H "Authorization: Bearer $(cat {token_file})"' if token_file else ""
    return f"curl -N {base_url}/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


def main() -> int:
    from pddjax.model.meta import model_facts
    from serving.client import Client, make_request

    cfg, tok = model_facts("smollm2-135m")  # tokenizer only: shows which text each tier made

    state = os.path.join(tempfile.mkdtemp(prefix="pddjax-demo-"), "state.json")
    print("starting the stack: pddjax up " + " ".join(WAN + CONTEXT) + " (P, RLD, MD, router; real model) ...\n"
          "  each engine compiles a few step shapes before it serves and the rest in the background:\n"
          "  seconds with a warm compile cache, about a minute the first time on a fresh machine", flush=True)
    t0 = time.perf_counter()
    proc = start_stack(state)
    try:
        with open(state) as f:
            st = json.load(f)
        print(f"up in {time.perf_counter() - t0:.0f} s: router {st['router']}, MD behind the WAN link "
              f"{st['wan']['address']} ({st['wan']['mbps']:.0f} Mb/s, {st['wan']['latency_ms']:.0f} ms)")
        if st.get("openai"):
            print(f"OpenAI-compatible API on {st['openai']}: while the demo runs, chat from another terminal with\n"
                  f"  {curl_line(st['openai'])}")
        client = Client(st["router"])
        t1 = time.perf_counter()
        print(f"\n>>> {FIRST_TURN}\n", flush=True)  # streamed as soon as the stack serves
        first: list[float] = []

        def show(m) -> None:
            first or first.append(time.perf_counter() - t0)
            print(m.text, end="", flush=True)

        client.generate(make_request(chat=[{"role": "user", "content": FIRST_TURN}], max_tokens=16, pipeline="pdd"),
                        timeout=600, on_tokens=show)
        print(f"\n[first token {first[0] if first else 0:.0f} s after `pddjax up` started]\n")
        print("warming up on another logbook (the long context's step shapes, the link and RLD measured) ...",
              flush=True)
        client.generate(make_request(chat=[{"role": "user", "content": doc_message(year=1908)}],
                                     max_tokens=DOC_MAX_TOKENS, pipeline="pdd", ignore_eos=True), timeout=600)
        print(f"warm in {time.perf_counter() - t1:.0f} s")

        messages = [{"role": "user", "content": doc_message()}]
        n_prompt = len(tok.encode(tok.apply_chat_template(messages)))
        print(f"\n>>> [a logbook of {DOC_ENTRIES} entries, {n_prompt} prompt tokens: "
              f"{n_prompt * cfg.kv_bytes_per_token / 1e6:.0f} MB of KV that MD has never seen]\n>>> {DOC_QUESTION}\n")
        d, i = auto_would_pick(client, cfg, n_prompt, DOC_MAX_TOKENS)
        if d.pipeline != "pdd":
            print(f"[auto would pick {d.pipeline} ({d.reason}) from the router's estimates now: RLD at "
                  f"{i.relay_tokens_per_s:.0f} tok/s would make {d.output_tokens} tokens in {d.relay_finish_s:.1f} s, "
                  f"the KV needs ~{d.transfer_s:.1f} s at {8e-6 * i.wan_bytes_per_s:.0f} Mb/s; this turn asks for pdd]")
        r = turn(client, tok, cfg, messages, DOC_MAX_TOKENS, "auto" if d.pipeline == "pdd" else "pdd")
        messages.append({"role": "assistant", "content": r.text})
        for user in TURNS:
            messages.append({"role": "user", "content": user})
            print(f"\n>>> {user}\n", flush=True)
            r = turn(client, tok, cfg, messages, TURN_MAX_TOKENS, "auto")
            messages.append({"role": "assistant", "content": r.text})
        client.close()
        print(f"\ndone in {time.perf_counter() - t0:.0f} s")
        return 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(os.path.dirname(state), ignore_errors=True)  # the state file's folder


if __name__ == "__main__":
    raise SystemExit(main())
