"""Soak test (issue 8, point 8; a script, not part of CI): a tiny-model stack under many
concurrent multi-turn sessions for a while, 30% of requests aborted at random points.

Checks at the end: every completed request's tokens equal the monolithic reference (no lost,
duplicated or reordered tokens), every tier is idle with no page held and integrity intact, and
the services' RSS and the router's open calls are flat (sampled every 30 s, with each engine
service's `pddjax_jit_compiles` and `pddjax_jit_executables`: RSS grows with the executables a
process holds, which `PDDJAX_STEP_EXECUTABLES` caps).

    .venv/bin/python tools/soak.py --minutes 3 --sessions 24 --json out/soak.json
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

from pddjax.engines.reference import ReferenceEngine  # noqa: E402
from pddjax.model.jax_setup import configure  # noqa: E402
from pddjax.model.registry import load_model  # noqa: E402
from pddjax.model.sampling_params import SamplingParams  # noqa: E402
from serving.client import Client, make_request  # noqa: E402
from tests.serving_stack import Stack  # noqa: E402
from tests.test_serving_pipelines import assert_idle  # noqa: E402

STACK = {"model": "tiny", "platform": "cpu",
         "engine": {"dtype": "float32", "page_size": 16, "num_pages": 1024, "max_step_tokens": 256, "max_rows": 32},
         "router": {"chunk_bytes": 4096}}


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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--abort-share", type=float, default=0.3)
    ap.add_argument("--json")
    ap.add_argument("--tracemalloc", metavar="ROLE", help="trace Python heap growth of ROLE's service "
                    "(PDDJAX_TRACEMALLOC; a report per sample, printed at the end)")
    args = ap.parse_args()
    configure()
    tiny = load_model("tiny")
    ref = ReferenceEngine(tiny.config, tiny.weights)
    stop_at = time.monotonic() + 60 * args.minutes
    counts = {"completed": 0, "aborted": 0, "mismatched": 0, "errors": 0}
    lock = threading.Lock()
    if args.tracemalloc:
        os.environ["PDDJAX_TRACEMALLOC"], os.environ["PDDJAX_TRACEMALLOC_ROLE"] = "6", args.tracemalloc
    with tempfile.TemporaryDirectory() as d:
        stack = Stack(STACK, d)
        try:
            pids = {c.role: c.proc.pid for c in stack.children}
            urls = {c.role: c.metrics for c in stack.children if c.role != "router"}
            samples = []

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
                    except grpc.RpcError:
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
                    time.sleep(min(30.0, max(1.0, stop_at - time.monotonic())))
                    samples.append({"t_s": round(time.monotonic() - t0),
                                    **{r: round(rss_mb(p), 1) for r, p in pids.items()},
                                    **{f"{r}_compiles": gauge(u) for r, u in urls.items()},
                                    **{f"{r}_held": gauge(u, "pddjax_jit_executables") for r, u in urls.items()},
                                    **dict(counts)})
                    print(json.dumps(samples[-1]), flush=True)
                    if args.tracemalloc and samples[-1]["t_s"] - last_report >= 25:  # snapshots are slow
                        last_report = samples[-1]["t_s"]
                        os.kill(pids[args.tracemalloc], signal.SIGUSR2)
                for f in futs:
                    f.result()
            assert_idle(stack, timeout=30)
            out = {"minutes": args.minutes, "sessions": args.sessions, "counts": counts, "samples": samples,
                   "idle_after": True}
        finally:
            stack.close()
            if args.tracemalloc:
                with open(os.path.join(d, "services.log"), errors="replace") as f:
                    report = [ln for ln in f if ln.startswith(("memdiag", "  "))]
                print("".join(report[-400:]))
    print(json.dumps(out["counts"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if counts["mismatched"] == 0 and counts["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
