"""`bench serve`'s own client over a `peer_load` load, for `bench serve --peer`.

`history` sends a run's history items unmeasured (sessions concurrently, each session's turns in
order, as fast as they go: `bench serve`'s warm phase), whichever client then measures; `measured`
sends every measured item at its `at_ms` after the phase starts (one thread per request, open
loop: the fixed schedule AIPerf's `--fixed-schedule` follows), each through
`openai_driver.stream_one`, the `--openai-url` path's streamed completion (greedy, `ignore_eos`,
`max_tokens` the item's, no session header: AIPerf sends none). `Record.send_s` - `at_ms` is this
client's schedule lag. Both return `replay.Record`s (TTFT, vLLM's ITL per message in
`itl_message_ms`, TPOT, e2e).
"""

from __future__ import annotations

import threading
import time

from serving.bench.serve.openai_driver import stream_one
from serving.bench.serve.peer_load import LoadItem
from serving.bench.serve.replay import Progress, Record


def _send(client, model: str, item: LoadItem, t0: float) -> Record:
    import openai

    sent = time.perf_counter()
    rec = Record(item.request_id, item.session_id, item.turn, 0.0, len(item.ids), send_s=sent - t0)
    try:
        out = stream_one(client, model, rec, item.text, item.max_tokens, None, sent)
        if len(out) != item.max_tokens:
            rec.error = f"{len(out)} output tokens, asked {item.max_tokens}"
    except openai.APIError as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


def _client(url: str, key: str | None):
    import openai

    return openai.OpenAI(base_url=url, api_key=key or "none", max_retries=0, timeout=900)


def history(url: str, model: str, key: str | None, items: list[LoadItem], label: str) -> list[Record]:
    """The history items, unmeasured: sessions concurrently, turns in order."""
    sessions: dict[int, list[LoadItem]] = {}
    for it in items:
        sessions.setdefault(it.session_id, []).append(it)
    out: list[Record] = []
    if not items:
        return out
    client, lock, bar, t0 = _client(url, key), threading.Lock(), Progress(label, len(items)), time.perf_counter()

    def session(turns):
        for it in sorted(turns, key=lambda it: it.turn):
            rec = _send(client, model, it, t0)
            with lock:
                out.append(rec)
            bar.tick()

    _run_all(session, list(sessions.values()), bar, client)
    return out


def measured(url: str, model: str, key: str | None, items: list[LoadItem], label: str) -> tuple[list[Record], float]:
    """Every item at its `at_ms` (open loop) -> (records by send time, wall seconds of the phase)."""
    out: list[Record] = []
    client, lock, bar = _client(url, key), threading.Lock(), Progress(label, len(items))
    t0 = time.perf_counter() + 0.05  # the threads are started before the schedule's zero

    def one(it: LoadItem):
        time.sleep(max(0.0, t0 + it.at_ms / 1e3 - time.perf_counter()))
        rec = _send(client, model, it, t0)
        with lock:
            out.append(rec)
        bar.tick()

    _run_all(one, items, bar, client)
    out.sort(key=lambda r: (r.send_s, r.request_id))
    return out, time.perf_counter() - t0


def _run_all(target, args: list, bar, client) -> None:
    """`target(a)` for every a in `args`, each on its own thread, all joined; then the progress
    line ends and the client closes."""
    threads = [threading.Thread(target=target, args=(a,), daemon=True) for a in args]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        bar.finish()
        client.close()


def schedule_lag_ms(records: list[Record], items: list[LoadItem]) -> list[float]:
    """Each measured request's send time past its schedule (ms)."""
    at = {it.request_id: it.at_ms for it in items}
    return [1e3 * r.send_s - at[r.request_id] for r in records if r.request_id in at]
