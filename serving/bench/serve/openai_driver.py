"""`pddjax bench serve --openai-url URL`: the same trace through any OpenAI-compatible server.

No stack is started: the trace (generated or `--trace`) is replayed against URL with the
official `openai` client, as streamed completions with token-id prompts (the trace's own ids,
so contexts and prefix hits are the trace's), `max_tokens` the trace's, greedy. Sent too, for
servers that take them (pddjax's gateway, vLLM, SGLang): `ignore_eos` (forced output
lengths), `return_token_ids` (the next turn extends the output the model really produced;
without ids a turn's output is the trace's synthetic one) and the session as `x-session-id`.
The two phases are `replay.replay`'s: the history turns unmeasured (as fast as they go),
then the measured turns paced by arrival and think time; the figures are `bench serve`'s
(`figures.mode_figures`, one mode named `openai`; no WAN bytes: the line is the server's).
With pddjax behind the URL the `pddjax` extension fills the pipeline, the relay/main split and
(when its gateway runs with PDDJAX_OPENAI_CACHE_HITS=1, the operator's opt-in) the caches' hits;
elsewhere they stay empty.
"""

from __future__ import annotations

import json
import threading
import time

from serving.bench.serve.figures import identity_check, markdown, mode_figures
from serving.bench.serve.replay import Progress, Record


def first_model(client) -> str:
    models = client.models.list().data
    if not models:
        from pddjax.errors import UserError

        raise UserError("the OpenAI endpoint lists no model: pass --openai-model")
    return models[0].id


def stream_one(client, model: str, rec: Record, prompt: list[int] | str, max_tokens: int, session: str | None,
               sent: float) -> list[int]:
    """One streamed completion (greedy, `ignore_eos`) into `rec`; -> the output token ids (empty if the
    server sent none). `session`: sent as `x-session-id` (None: no header)."""
    times, toks, ext = [], [], {}
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_headers={"x-session-id": session} if session is not None else None,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    for ch in stream:
        ext = getattr(ch, "pddjax", None) or ext
        for c in ch.choices:
            ids = list(getattr(c, "token_ids", None) or [])
            k = len(ids) or (1 if c.text else 0)
            if k:
                src = {"relay": 2, "main": 3}.get((getattr(ch, "pddjax", None) or {}).get("source"), 0)
                times.append((time.perf_counter(), k, src))
            toks += ids
    rec.token_ids, rec.pipeline = toks, ext.get("pipeline", "openai")
    rec.relay_tokens, rec.main_tokens = int(ext.get("relay_tokens", 0)), int(ext.get("main_tokens", 0))
    rec.cached_on_main, rec.cached_on_prefill = int(ext.get("cached_on_main", 0)), int(ext.get("cached_on_prefill", 0))
    rec.kv_bytes_to_main, rec.explain = int(ext.get("kv_bytes_to_main", 0)), ext.get("explain", "")
    if times:
        first, last = times[0][0], times[-1][0]
        n = sum(k for _, k, _ in times)
        rec.ttft_ms, rec.e2e_ms = 1e3 * (first - sent), 1e3 * (last - sent)
        rec.tpot_ms = 1e3 * (last - first) / (n - 1) if n > 1 else float("nan")
        for (ta, _, _), (tb, k, _) in zip(times, times[1:]):
            rec.itl_ms += [1e3 * (tb - ta) / k] * k
            rec.itl_message_ms.append(1e3 * (tb - ta))
        relay_t = [t for t, _, s in times if s == 2]
        main_t = [t for t, _, s in times if s == 3]
        if relay_t and main_t:
            rec.handoff_gap_ms = 1e3 * (main_t[0] - relay_t[-1])
    return toks


def replay_openai(client, model: str, trace, builder, label: str) -> tuple[list[Record], float, list[Record], float]:
    """-> (measured records, measured wall time, history records, history wall time)."""
    import openai

    sessions: dict[int, list] = {}
    for r in sorted(trace, key=lambda r: (r.session_id, r.turn)):
        sessions.setdefault(r.session_id, []).append(r)
    lock, clock = threading.Lock(), {"t0": time.perf_counter()}

    def one(req) -> tuple[Record, float]:
        with lock:
            prompt = builder.prompt_ids(req)
        sent = time.perf_counter()
        rec = Record(req.request_id, req.session_id, req.turn, req.hit, len(prompt), send_s=sent - clock["t0"])
        try:
            out = stream_one(client, model, rec, prompt, req.max_tokens, str(req.session_id), sent)
        except openai.APIError as e:
            rec.error, out = f"{type(e).__name__}: {e}", []
        with lock:
            builder.record_output(req, out)
        return rec, time.perf_counter()

    def phase(pick, paced: bool, bar_label: str) -> list[Record]:
        todo = {sid: [r for r in turns if pick(r)] for sid, turns in sessions.items()}
        todo = {sid: t for sid, t in todo.items() if t}
        out: list[Record] = []
        if not todo:
            return out
        bar = Progress(bar_label, sum(len(t) for t in todo.values()))

        def session(turns):
            prev_end = None
            for req in turns:
                if paced:
                    at = req.arrival_s if prev_end is None else max(req.arrival_s, prev_end - clock["t0"] + req.think_s)
                    time.sleep(max(0.0, at - (time.perf_counter() - clock["t0"])))
                rec, prev_end = one(req)
                with lock:
                    out.append(rec)
                bar.tick()

        threads = [threading.Thread(target=session, args=(t,), daemon=True) for t in todo.values()]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        bar.finish()
        return out

    history = phase(lambda r: r.arrival_s < 0, False, f"{label} (hist)")
    history_wall = time.perf_counter() - clock["t0"]
    clock["t0"] = time.perf_counter()
    records = phase(lambda r: r.arrival_s >= 0, True, label)
    wall = time.perf_counter() - clock["t0"]
    records.sort(key=lambda r: (r.send_s, r.request_id))
    return records, wall, history, history_wall


def run(args, trace, trace_seed: int, vocab_size: int, summary: dict) -> int:
    """The trace against `args.openai_url`; writes `args.json` like `bench serve` (mode `openai`)."""
    import openai

    from pddjax.workload import TokenBuilder

    client = openai.OpenAI(base_url=args.openai_url, api_key=args.openai_key or "none", max_retries=0, timeout=900)
    try:
        model = args.openai_model or first_model(client)
        records, wall, history, history_wall = replay_openai(client, model, trace, TokenBuilder(trace_seed, vocab_size),
                                                            "openai")
    finally:
        client.close()
    figures = mode_figures(records, wall, 0, 0)
    figures["history_s"], figures["history_errors"] = round(history_wall, 1), sum(r.error is not None for r in history)
    result = {"version": 1, "endpoint": args.openai_url, "model": model, "trace": {"path": args.trace,
              "seed": trace_seed, **summary}, "modes": {"openai": figures}, "targets": {},
              "outputs": identity_check({"openai": records}),
              "requests": {"openai": [{"request_id": r.request_id, "pipeline": r.pipeline, "ttft_ms": r.ttft_ms,
                                       "prompt_tokens": r.prompt_tokens, "cached_on_main": r.cached_on_main,
                                       "error": r.error} for r in records]}}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(result))
    errs = [r.error for r in records + history if r.error]
    if errs:
        print(f"openai: {len(errs)} requests failed, first: {errs[0]}")
    return 0
