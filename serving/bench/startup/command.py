"""`pddjax bench startup`: how long a stack takes to start, cold and warm, per service and phase.

For each ready mode (`[engine] ready`: "cover" serves once a covering few step shapes are
built and builds the rest in the background; "all" builds the whole stated set first) it runs
`pddjax up` twice on one fresh cache folder (PDDJAX_CACHE_DIR, so converted weights and JAX's
compilation cache start empty): cold, then warm. Each start measures, from the moment `up` is
spawned: `healthy_s` (every service SERVING: `up`'s state file written), `first_token_s` and
`done_s` of one streamed request through the router (pdd, so it crosses P, RLD and MD), and each
service's own phases (its ready file's `startup`: weights, shapes built before SERVING, KV
copies, and JAX's tracing / lowering / XLA compile / cache-read seconds and hits inside them,
pddjax/engines/startup_clock.py). Printed as a table and, with --json, written as
{"model", "runs": [{"ready", "cache", "healthy_s", "first_token_s", "done_s", "tokens",
"services": {role: startup}}]}. The stacks run one after another on this machine (all
services share its cores, as users' stacks do).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from pddjax import env
from pddjax.errors import UserError
from serving.bench.startup import table

CACHES = ("cold", "warm")


def register(bsub) -> None:
    p = bsub.add_parser("startup", help="time from `pddjax up` to healthy and to the first token, cold and warm, "
                                        "per service and phase")
    p.add_argument("--model", default="smollm2-135m", help="the stack's model (default smollm2-135m)")
    p.add_argument("--config", help="a stack config to start from (default: the packaged default stack)")
    p.add_argument("--ready", default="cover,all", help="ready modes to compare, in order (default cover,all)")
    p.add_argument("--caches", default="cold,warm", help="cold, warm or both (warm reuses the cold run's cache)")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds one start may take (default 1500)")
    p.add_argument("--json", help="also write the figures to this file")
    p.set_defaults(func=run_startup)


def stack_config(base: dict, model: str, ready: str) -> dict:
    return {**base, "model": model, "engine": {**base.get("engine", {}), "ready": ready}}


def one_start(stack: dict, cache_dir: str, workdir: str, timeout: float) -> dict:
    """`pddjax up` on `stack` with `cache_dir`, one pdd request, then stop -> the run's figures."""
    from serving.client import Client, make_request

    cfg, state = os.path.join(workdir, "stack.json"), os.path.join(workdir, "state.json")
    with open(cfg, "w") as f:
        json.dump(stack, f)
    if os.path.exists(state):
        os.remove(state)
    environ = {**os.environ, env.CACHE_DIR.name: cache_dir}
    environ.pop(env.JIT_CACHE_DIR.name, None)  # JAX's cache inside the fresh folder too
    log = open(os.path.join(workdir, "up.log"), "ab")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "serving", "up", "--config", cfg, "--port", "0", "--state", state],
                            stdout=log, stderr=subprocess.STDOUT, env=environ)
    try:
        while not os.path.exists(state):
            if proc.poll() is not None:
                raise UserError(f"pddjax up exited with {proc.returncode} while starting (log: {log.name})")
            if time.monotonic() - t0 > timeout:
                raise UserError(f"pddjax up was not healthy within {timeout:.0f} s (log: {log.name})")
            time.sleep(0.05)
        healthy = time.monotonic() - t0
        with open(state) as f:
            st = json.load(f)
        client = Client(st["router"])
        first: list[float] = []
        try:
            res = client.generate(make_request(prompt_ids=list(range(5, 69)), max_tokens=32, pipeline="pdd",
                                               ignore_eos=True),
                                  timeout=timeout, on_tokens=lambda _: first or first.append(time.monotonic() - t0))
        finally:
            client.close()
        done = time.monotonic() - t0
        return {"healthy_s": round(healthy, 2), "first_token_s": round(first[0], 2), "done_s": round(done, 2),
                "tokens": len(res.token_ids),
                "services": {s["role"]: s.get("startup") for s in st["services"] if s.get("startup")}}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def run_startup(args) -> int:
    from serving.config import default_stack, read_file

    readies = [r.strip() for r in args.ready.split(",") if r.strip()]
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    if not readies or any(r not in ("cover", "all") for r in readies):
        raise UserError(f"--ready takes cover and/or all, got {args.ready!r}")
    if not caches or any(c not in CACHES for c in caches):
        raise UserError(f"--caches takes cold and/or warm, got {args.caches!r}")
    base = read_file(args.config) if args.config else default_stack()
    runs = []
    for ready in readies:
        cache_dir = tempfile.mkdtemp(prefix="pddjax-startup-cache-")
        workdir = tempfile.mkdtemp(prefix="pddjax-startup-")
        try:
            if caches == ["warm"]:  # warm alone: fill the cache first, unmeasured
                one_start(stack_config(base, args.model, ready), cache_dir, workdir, args.timeout)
            for cache in caches:
                run = {"ready": ready, "cache": cache,
                       **one_start(stack_config(base, args.model, ready), cache_dir, workdir, args.timeout)}
                runs.append(run)
                print(table.run_line(run), flush=True)
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
            shutil.rmtree(workdir, ignore_errors=True)
    figures = {"model": args.model, "cpus": os.cpu_count(), "runs": runs}
    print(table.render(figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0
