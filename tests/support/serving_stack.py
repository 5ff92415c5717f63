"""Helpers for serving tests: a stack of separate service processes on loopback, with the
A -> B WanLink running in a background thread of the test process (so tests can slow it and
read its byte counters), always torn down (SIGTERM, then SIGKILL); another router over a running
stack's engine services (`Router`); and `pddjax up` as a subprocess.

TINY_ENGINE is the suite's one tiny engine table (configs/tiny.toml's, every default stated): a
module whose stacks differ from it only by accident uses it, so that one set of step programs
is compiled per cache (each other table compiles its own on an empty one). TINY_STACK is the
stack the modules of tests/serving share (tests/serving/conftest.py: `STACK = TINY_STACK`); its
router never gives MD up (`give_up_main`: what one module learns would change which of another
module's pdd requests hand off; tests/serving/router/test_give_up.py runs a router with it)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

from serving.bench.serve.compiles import wait_built
from serving.stack.up import Child, spawn, stop_all, wait_ready
from serving.stack.wanlink import WanLink

TINY_ENGINE = {"dtype": "float32", "page_size": 16, "num_pages": 256, "max_step_tokens": 128, "max_rows": 8}
TINY_STACK = {"model": "tiny", "platform": "cpu", "engine": TINY_ENGINE,
              "router": {"chunk_bytes": 4096, "handoff_threshold": 48, "give_up_main": False}}


class LinkThread:
    """A WanLink on its own event loop thread."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.link = WanLink(host, int(port))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self.link.start(), self.loop).result(10)

    def set(self, mbps: float = 0.0, latency_ms: float = 0.0) -> None:
        self.link.mbps, self.link.latency_ms = mbps, latency_ms

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.link.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _start_router(stack: dict, addr: dict, main_wan: str, workdir: str, log, timeout: float,
                  name: str = "router") -> Child:
    """A router process over the engine services at `addr`, P and RLD reaching MD at `main_wan`."""
    rstack = {**stack, "router": {**stack.get("router", {}), "prefill": addr["prefill"], "relay": addr["relay"],
                                  "main": addr["main"], "main_wan": main_wan}}
    rcfg = os.path.join(workdir, f"{name}.json")
    with open(rcfg, "w") as f:
        json.dump(rstack, f)
    router = spawn("router", rcfg, workdir, log=log, name=name)
    try:
        asyncio.run(wait_ready([router], timeout))
    except BaseException:
        stop_all([router])
        raise
    return router


class Stack:
    """P, RLD, MD and the router as processes; P and RLD reach MD through `link`."""

    def __init__(self, stack: dict, workdir: str, timeout: float = 180.0, use_link: bool = True):
        self.children: list[Child] = []
        self.link: LinkThread | None = None
        self.config, self.workdir, self.timeout = stack, workdir, timeout
        self.log = open(os.path.join(workdir, "services.log"), "ab")
        try:
            cfg = os.path.join(workdir, "stack.json")
            with open(cfg, "w") as f:
                json.dump(stack, f)
            self.children = [spawn(r, cfg, workdir, log=self.log) for r in ("prefill", "relay", "main")]
            asyncio.run(wait_ready(self.children, timeout))
            wait_built({c.role: c.metrics for c in self.children}, timeout)  # the suite builds no rest: returns at once
            self.addr = {c.role: c.address for c in self.children}
            self.link = LinkThread(self.addr["main"])
            router = _start_router(stack, self.addr, self.link.address if use_link else self.addr["main"], workdir,
                                   self.log, timeout)
            self.children.append(router)
            self.addr["router"] = router.address
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        stop_all(self.children)
        if self.link is not None:
            self.link.close()
        self.log.close()


class Router:
    """Another router, with a config of its own (`overrides`: the tables that differ from the
    stack's, e.g. `router`, `wan`) and its own A -> B link to MD, over `stack`'s running P, RLD
    and MD: what a test of a router setting needs without engines of its own. `addr`, `link` and
    `children` (the engines, then this router) as a Stack's; `close` stops this router and its
    link only. The engines' caches hold what earlier users sent them (prefix hits: draw prompts
    no other user of the stack draws)."""

    _count = 0

    def __init__(self, stack: Stack, overrides: dict):
        Router._count += 1
        self.link: LinkThread | None = LinkThread(stack.addr["main"])
        try:
            engines = {r: stack.addr[r] for r in ("prefill", "relay", "main")}
            self.router = _start_router({**stack.config, **overrides}, engines, self.link.address, stack.workdir,
                                        stack.log, stack.timeout, name=f"router{Router._count}")
        except BaseException:
            self.link.close()
            raise
        self.addr = {**engines, "router": self.router.address}
        self.children = [c for c in stack.children if c.role != "router"] + [self.router]

    def close(self) -> None:
        stop_all([self.router])
        self.link.close()


class UpProcess:
    """`pddjax up ...` as a subprocess; waits for its state file; always stopped."""

    def __init__(self, args: list[str], state_file: str, timeout: float = 240.0):
        self.state_file = state_file
        self.proc = subprocess.Popen([sys.executable, "-m", "serving", "up", "--state", state_file, *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.state = None
        deadline = time.monotonic() + timeout
        try:
            while not os.path.exists(state_file):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"pddjax up exited with {self.proc.returncode}: {self.proc.stdout.read()}")
                if time.monotonic() > deadline:
                    raise TimeoutError("pddjax up did not write its state file")
                time.sleep(0.2)
            with open(state_file) as f:
                self.state = json.load(f)
            wait_built({s["role"]: s.get("metrics") for s in self.state["services"] if s["role"] != "router"},
                       max(10.0, deadline - time.monotonic()))
        except BaseException:
            self.close()
            raise

    def read_state(self) -> dict:
        with open(self.state_file) as f:
            return json.load(f)

    def close(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for s in (self.state or {}).get("services", []):  # never leave a child behind
            try:
                os.kill(s["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.proc.returncode


def launch_up(workdir, config: dict | str, *args: str, timeout: float = 240.0) -> UpProcess:
    """`pddjax up --config CONFIG --port 0 ARGS...` with its state file in `workdir`; a dict
    `config` is written to workdir/stack.json first, a str is a config file's path."""
    if isinstance(config, dict):
        path = os.path.join(str(workdir), "stack.json")
        with open(path, "w") as f:
            json.dump(config, f)
        config = path
    return UpProcess(["--config", config, "--port", "0", *args], os.path.join(str(workdir), "state.json"), timeout)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
