"""`pddjax bench serve --peer aiperf`: bench serve's own client and a peer's (AIPerf) on the same load
through the same OpenAI gateway, one after the other; both sets of TTFT / ITL / TPOT and their ratios.

The gateway: `--openai-url` (any OpenAI-compatible server; `--model` names its tokenizer), else a
`pddjax up` stack started here (`--config`, `--model`; the packaged default stack without them) and
stopped at the end. The load (`peer_load`): the trace (`--quick`, `--trace`, ...) as text prompts
that the server's tokenizer turns into the trace's lengths and shared prefixes, each measured
request at its trace arrival time (a fixed schedule, open loop), `max_tokens` its output length,
`ignore_eos`, greedy. A run: the history turns, unmeasured, by our client, then the measured
requests by the run's client; each run has its own salt (no cached page carries over from the one
before). Unless `--no-warmup`, a first run by our client, unmeasured, builds the step shapes the
load uses. Then ours and the peer's (`--peer-first` swaps them; drift on a shared machine shows
as the order's effect, so run both orders). `--peer-artifacts DIR` keeps the load files and the
peer's output; otherwise they go with a temporary folder. The JSON: `ours`, `peer` (its summary and
its records with our percentiles), `comparison` (`peer_compare.compare`), `runs` (per run: wall time,
load average, the client's schedule lag and CPU seconds).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from pddjax.errors import UserError
from serving.bench.serve import peer_aiperf, peer_compare, peer_load, peer_replay
from serving.bench.serve.figures import pct

PEERS = ("aiperf",)


def add_arguments(p) -> None:
    g = p.add_argument_group("a peer's benchmark client on the same load (serving/bench/serve/peer_command.py)")
    g.add_argument("--peer", choices=PEERS, help="run our client and this one on the same load through one gateway")
    g.add_argument("--peer-venv", metavar="DIR", help="the peer's own venv (default: under the pddjax cache, "
                                                      "created with the `peer` extra's pin where missing)")
    g.add_argument("--peer-no-install", action="store_true", help="fail instead of creating the peer's venv")
    g.add_argument("--peer-first", action="store_true", help="run the peer's client before ours")
    g.add_argument("--peer-artifacts", metavar="DIR", help="keep the load files and the peer's output here")


@contextlib.contextmanager
def gateway(args, workdir: str):
    """-> the OpenAI base URL: `--openai-url`, or a `pddjax up` stack's for the duration."""
    if args.openai_url:
        yield args.openai_url
        return
    state, log = os.path.join(workdir, "up.json"), open(os.path.join(workdir, "up.log"), "w")
    cmd = [sys.executable, "-m", "serving", "up", "--port", "0", "--state", state, "--model", args.model]
    proc = subprocess.Popen(cmd + (["--config", args.config] if args.config else []), stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        print("peer: starting the stack (pddjax up)", file=sys.stderr, flush=True)
        deadline = time.monotonic() + 1200
        while not os.path.exists(state):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise UserError(f"pddjax up did not start (log: {log.name})")
            time.sleep(0.5)
        with open(state) as f:
            yield json.load(f)["openai"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _client_cpu_s() -> dict:
    """CPU seconds so far of our client (this process: it runs nothing else while it measures) and of
    the peer (the children waited for: AIPerf and the processes it waited for)."""
    import resource

    ours = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"ours": ours.ru_utime + ours.ru_stime, "peer": kids.ru_utime + kids.ru_stime}


def _run_peer(exe: str, url: str, model: str, repo: str, hub: str, items, workdir: str, key: str | None) -> dict:
    load = os.path.join(workdir, "peer_load.jsonl")
    out = os.path.join(workdir, "aiperf")
    peer_load.write_aiperf(items, load)
    log = os.path.join(workdir, "aiperf.log")
    with open(log, "w") as f:
        p = subprocess.run(peer_aiperf.command(exe, url, model, repo, load, out, key), stdout=f,
                           stderr=subprocess.STDOUT, env=peer_aiperf.environment(hub, workdir), cwd=workdir)
    if p.returncode != 0 or not os.path.exists(os.path.join(out, peer_aiperf.SUMMARY)):
        with open(log, errors="replace") as f:
            tail = f.read()[-2000:]
        raise UserError(f"AIPerf exited {p.returncode}: ...{tail}")
    return {"records": peer_aiperf.read_records(out), "summary": peer_aiperf.read_summary(out)}


def run(args, trace, trace_seed: int, model_config, summary: dict) -> int:
    from pddjax.model.meta import ModelNotFound, model_facts
    from serving.bench.serve.openai_driver import first_model

    try:
        tokenizer = model_facts(args.model)[1]
    except ModelNotFound as e:
        raise UserError(str(e)) from None
    if tokenizer is None:
        raise UserError(f"--peer sends text: model {args.model} has no tokenizer")
    words = peer_load.WordMap(tokenizer)
    exe = peer_aiperf.ensure(args.peer_venv or peer_aiperf.default_venv(), install=not args.peer_no_install)
    workdir = args.peer_artifacts or tempfile.mkdtemp(prefix="pddjax-bench-peer-")
    os.makedirs(workdir, exist_ok=True)
    hub = os.path.join(workdir, "hub")
    repo = peer_aiperf.write_tokenizer(tokenizer, args.model, model_config.max_context, hub)
    loads = {}
    for salt in range(3):  # 0: the warm-up's, then one per measured run
        loads[salt] = peer_load.build(trace, trace_seed, words, salt)
        for item in loads[salt][0] + loads[salt][1]:
            words.check(item)
    order = ["peer", "ours"] if args.peer_first else ["ours", "peer"]
    runs, ours_recs, peer_out = [], [], None
    t_start = time.monotonic()
    try:
        with gateway(args, workdir) as url:
            import openai

            with openai.OpenAI(base_url=url, api_key=args.openai_key or "none", max_retries=0) as c:
                model = args.openai_model or first_model(c)
            key = args.openai_key
            if not args.no_warmup:
                hist, meas = loads[0]
                peer_replay.history(url, model, key, hist, "warm-up (hist)")
                peer_replay.measured(url, model, key, meas, "warm-up")
            for salt, side in enumerate(order, start=1):
                hist, meas = loads[salt]
                hist_errs = [r.error for r in peer_replay.history(url, model, key, hist, f"{side} (hist)") if r.error]
                t0, load0, cpu0 = time.monotonic(), os.getloadavg()[0], _client_cpu_s()
                entry = {"client": side, "salt": salt, "history_errors": len(hist_errs)}
                if side == "ours":
                    ours_recs, _ = peer_replay.measured(url, model, key, meas, "ours")
                    entry["schedule_lag_ms"] = pct(peer_replay.schedule_lag_ms(ours_recs, meas))
                    errs = [r.error for r in ours_recs if r.error]
                else:
                    print(f"peer: {args.peer} ({peer_aiperf.REQUIREMENT}) on {len(meas)} requests", file=sys.stderr,
                          flush=True)
                    peer_out = _run_peer(exe, url, model, repo, hub, meas, workdir, key)
                    entry["schedule_lag_p50_ms"] = peer_out["summary"].get("schedule_lag_p50_ms")
                    errs = [r.error for r in peer_out["records"] if r.error]
                entry["errors"], entry["first_error"] = len(errs), (errs or hist_errs or [None])[0]
                if errs or hist_errs:
                    print(f"{side}: {len(errs)} measured and {len(hist_errs)} history requests failed, first: "
                          f"{entry['first_error']}", file=sys.stderr)
                cpu = _client_cpu_s()
                runs.append({**entry, "wall_s": round(time.monotonic() - t0, 1),
                             "client_cpu_s": round(cpu[side] - cpu0[side], 2),
                             "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]})
    finally:
        if not args.peer_artifacts:
            shutil.rmtree(workdir, ignore_errors=True)
    our = peer_compare.ours(ours_recs)
    recs = peer_compare.peer_records(peer_out["records"])
    measured = loads[1][1]
    result = {"version": 1, "model": args.model, "endpoint": args.openai_url or "pddjax up (started by the bench)",
              "served_model": model,
              "trace": {"path": args.trace, "seed": trace_seed, **summary},
              "load": {"requests": len(measured), "history": len(loads[1][0]),
                       "span_s": round((measured[-1].at_ms - measured[0].at_ms) / 1e3, 2) if measured else 0.0,
                       "prompt_tokens": sum(len(it.ids) for it in measured),
                       "output_tokens": sum(it.max_tokens for it in measured), "warmup": not args.no_warmup},
              "order": order, "runs": runs, "ours": our,
              "peer": {"name": args.peer, "requirement": peer_aiperf.REQUIREMENT, "summary": peer_out["summary"],
                       "records": recs},
              "comparison": peer_compare.compare(our, peer_out["summary"], recs),
              "wall_s": round(time.monotonic() - t_start, 1)}
    print(peer_compare.markdown(result))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0
