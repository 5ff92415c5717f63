"""Soak test (issues 8 and 17; a script, plus a short run in tests/tools/test_soak.py): a tiny-model
stack under many concurrent multi-turn sessions for a while, a share of requests aborted by
the client at random points.

Figures: requests completed / aborted / mismatched / errors; each service's RSS (start, after
the warm-up, end, max) and each engine service's active KV pages (pddjax_kv_pages_active),
sampled every --sample-seconds, with the step executables built and held
(pddjax_jit_compiles, pddjax_jit_executables); every tier's requests and pages once the load
has stopped. The verdict (`verdict`) fails the run, exit code 1, with one line per breach:
  - a completed request's tokens differ from the monolithic reference (an aborted one's are
    not a prefix of it), or a request failed (a gRPC error other than the client's own cancel);
  - a tier still holds a request or a page --idle-seconds after the load stopped, or its
    integrity check fails;
  - a service's RSS at the end exceeds its RSS after the warm-up (the first sample at or past
    --warmup-seconds) by more than --rss-growth-mb.

    .venv/bin/python tools/soak.py --minutes 10 --sessions 24 --json out/soak.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.request

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from serving.client import Client, make_request  # noqa: E402
from serving.pb import cluster_pb2, cluster_pb2_grpc  # noqa: E402

STACK = {"model": "tiny", "platform": "cpu",
         "engine": {"dtype": "float32", "page_size": 16, "num_pages": 1024, "max_step_tokens": 256, "max_rows": 32},
         "router": {"chunk_bytes": 4096}}
# --small: configs/tiny.toml's engines (a smaller shape set to precompile: a quick start for a short run)
SMALL = {**STACK, "engine": {**STACK["engine"], "num_pages": 256, "max_step_tokens": 128, "max_rows": 8}}
ENGINE_ROLES = ("prefill", "relay", "main")
RSS_GROWTH_MB = 64.0  # per service, end against after the warm-up
WARMUP_SECONDS = 60.0
IDLE_SECONDS = 30.0  # below the decode services' 60 s lease: a leaked reservation is still seen


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def gauge(url: str | None, name: str = "pddjax_jit_compiles") -> int | None:
    """A gauge of the service's metrics (None without an endpoint or engine)."""
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return int(float(line.split()[1]))
    return None


def tiers_after(addr: dict, timeout: float) -> dict:
    """Each tier's {requests, pages, integrity_error} once all are idle, or as they are at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        out = {}
        for role in ENGINE_ROLES:
            with grpc.insecure_channel(addr[role]) as ch:
                stub = (cluster_pb2_grpc.PrefillStub if role == "prefill" else cluster_pb2_grpc.DecodeStub)(ch)
                i = stub.Info(cluster_pb2.InfoRequest(), timeout=10)
            out[role] = {"requests": i.requests, "pages": i.pages_active, "integrity_error": i.integrity_error}
        if all(v["requests"] == v["pages"] == 0 for v in out.values()) or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def verdict(figures: dict, rss_growth_mb: float = RSS_GROWTH_MB) -> list[str]:
    """One sentence per breach of the soak's bounds (none: the run passes). `figures`: main's
    output ({"counts", "rss_mb": {role: {"warm", "end", ...}}, "after": {role: {...}}})."""
    c, bad = figures["counts"], []
    if c["mismatched"]:
        bad.append(f"{c['mismatched']} requests' tokens differ from the reference")
    if c["errors"]:
        bad.append(f"{c['errors']} requests failed")
    if not c["completed"]:
        bad.append("no request completed")
    for role, t in figures["after"].items():
        if t["requests"] or t["pages"]:
            bad.append(f"{role} still holds {t['requests']} requests and {t['pages']} pages after the load")
        if t["integrity_error"]:
            bad.append(f"{role} fails its integrity check: {t['integrity_error']}")
    for role, r in figures["rss_mb"].items():
        if r["end"] - r["warm"] > rss_growth_mb:
            bad.append(f"{role} RSS grew {r['end'] - r['warm']:.0f} MB after the warm-up ({r['warm']:.0f} -> "
                       f"{r['end']:.0f} MB), more than {rss_growth_mb:g}")
    return bad


def _rss_figures(start: dict, samples: list[dict], warmup_s: float) -> dict:
    warm = next((s for s in samples if s["t_s"] >= warmup_s), samples[-1])
    return {role: {"start": round(start[role], 1), "warm": warm[role], "end": samples[-1][role],
                   "max": max(s[role] for s in samples)} for role in start}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--abort-share", type=float, default=0.3)
    ap.add_argument("--sample-seconds", type=float, default=30.0)
    ap.add_argument("--warmup-seconds", type=float, default=WARMUP_SECONDS)
    ap.add_argument("--rss-growth-mb", type=float, default=RSS_GROWTH_MB)
    ap.add_argument("--idle-seconds", type=float, default=IDLE_SECONDS)
    ap.add_argument("--small", action="store_true", help="configs/tiny.toml's engines (quick to start)")
    ap.add_argument("--json")
    ap.add_argument("--tracemalloc", metavar="ROLE", help="trace Python heap growth of ROLE's service "
                    "(PDDJAX_TRACEMALLOC; a report per sample, printed at the end)")
    args = ap.parse_args(argv)
    from pddjax import env
    from pddjax.engines.reference import ReferenceEngine
    from pddjax.model.jax_setup import configure
    from pddjax.model.registry import load_model
    from pddjax.model.sampling_params import SamplingParams
    from tests.support.serving_stack import Stack

    configure()
    tiny = load_model("tiny")
    ref = ReferenceEngine(tiny.config, tiny.weights)
    counts = {"completed": 0, "aborted": 0, "mismatched": 0, "errors": 0}
    lock = threading.Lock()
    if args.tracemalloc:
        os.environ[env.TRACEMALLOC.name], os.environ[env.TRACEMALLOC_ROLE.name] = "6", args.tracemalloc
    with tempfile.TemporaryDirectory() as d:
        stack = Stack(SMALL if args.small else STACK, d, timeout=env.READY_SECONDS.get())
        try:
            pids = {c.role: c.proc.pid for c in stack.children}
            urls = {c.role: c.metrics for c in stack.children if c.role != "router"}
            start_rss, samples = {r: rss_mb(p) for r, p in pids.items()}, []
            stop_at = time.monotonic() + 60 * args.minutes

            def session(sid: int):
                rng = random.Random(sid)
                c = Client(stack.addr["router"])
                context = np.random.default_rng(sid).integers(3, 500, 24).tolist()
                turn = 0
                while time.monotonic() < stop_at:
                    turn += 1
                    prompt = context + np.random.default_rng(sid * 1000 + turn).integers(3, 500, 6).tolist()
                    if len(prompt) > 400:
                        prompt = prompt[-64:]
                    abort_after = rng.randint(0, 5) if rng.random() < args.abort_share else None
                    req = make_request(prompt, max_tokens=10,
                                       pipeline=rng.choice(["pdd", "pd-cross", "pd-local", "auto"]),
                                       ignore_eos=True, session_id=f"s{sid}")
                    try:
                        toks = c.stream_tokens(req, timeout=120, cancel_after=abort_after)
                    except grpc.RpcError as e:
                        print(f"soak: session {sid} turn {turn}: {e.code().name} {e.details()}", flush=True)
                        with lock:
                            counts["errors"] += 1
                        continue
                    want = ref.generate(prompt, SamplingParams(), 10, ()).token_ids
                    with lock:
                        if abort_after is not None and len(toks) < 10:
                            counts["aborted"] += 1
                            counts["mismatched"] += toks != want[: len(toks)]
                        else:
                            counts["completed"] += 1
                            counts["mismatched"] += toks != want
                    context = prompt + toks
                c.close()

            t0, last_report = time.monotonic(), -60.0
            with concurrent.futures.ThreadPoolExecutor(args.sessions) as pool:
                futs = [pool.submit(session, i) for i in range(args.sessions)]
                while not all(f.done() for f in futs):
                    time.sleep(min(args.sample_seconds, max(0.5, stop_at - time.monotonic())))
                    samples.append({"t_s": round(time.monotonic() - t0, 1),
                                    **{r: round(rss_mb(p), 1) for r, p in pids.items()},
                                    **{f"{r}_pages": gauge(u, "pddjax_kv_pages_active") for r, u in urls.items()},
                                    **{f"{r}_compiles": gauge(u) for r, u in urls.items()},
                                    **{f"{r}_held": gauge(u, "pddjax_jit_executables") for r, u in urls.items()},
                                    **dict(counts)})
                    print(json.dumps(samples[-1]), flush=True)
                    if args.tracemalloc and samples[-1]["t_s"] - last_report >= 25:  # snapshots are slow
                        last_report = samples[-1]["t_s"]
                        os.kill(pids[args.tracemalloc], signal.SIGUSR2)
                for f in futs:
                    f.result()
            after = tiers_after(stack.addr, args.idle_seconds)
            samples.append({"t_s": round(time.monotonic() - t0, 1),  # the end: idle
                            **{r: round(rss_mb(p), 1) for r, p in pids.items()}})
            rss = _rss_figures(start_rss, samples, args.warmup_seconds)
            out = {"minutes": args.minutes, "sessions": args.sessions, "abort_share": args.abort_share,
                   "small": args.small, "counts": counts, "rss_mb": rss, "after": after, "samples": samples}
        finally:
            stack.close()
            if args.tracemalloc:
                with open(os.path.join(d, "services.log"), errors="replace") as f:
                    report = [ln for ln in f if ln.startswith(("memdiag", "  "))]
                print("".join(report[-400:]))
    out["failures"] = verdict(out, args.rss_growth_mb)
    print(json.dumps({k: out[k] for k in ("counts", "rss_mb", "after", "failures")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    for line in out["failures"]:
        print(f"soak FAILED: {line}", file=sys.stderr)
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
