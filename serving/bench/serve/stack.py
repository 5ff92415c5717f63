"""`pddjax bench serve`'s stacks: P, RLD, MD and the router as `pddjax serve` processes, MD behind
the emulated WAN (`LinkThread`, a `WanLink` on its own event loop), P pinned to its own cores
(`cluster_cpus`); the CPU seconds each used, and the step compiles each engine service reported
when it became ready (`compiles_at_ready`, for `compiles.after_ready`)."""

from __future__ import annotations

import asyncio
import os
import threading

from serving.bench.serve import compiles
from serving.engine.steplog import stat_cpu_s


class LinkThread:
    """The WanLink on its own event-loop thread (so the benchmark's sync clients can run)."""

    def __init__(self, target: str, wan: dict):
        from serving.stack.wanlink import WanLink

        self.link = WanLink.from_settings(target, wan)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="wanlink", daemon=True)
        self.thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self.link.start(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.link.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def cluster_cpus() -> dict[str, list[int]]:
    """Cores per service, as on separate accelerators: P gets its own (a P instance is its own
    GPU in the report, and TTFT is mostly P's prefill), the decoders get the rest: with 3+ CPUs
    RLD and MD get a third each (MD's own cores are its own datacenter); with 2, RLD and MD share
    the second core (they overlap only until a handoff). The router and this process (client
    threads, the WAN emulator) float: on 2 CPUs, putting them on the decoders' core overloaded
    it (TTFT P99 of every mode +50-200%). Unpinned, every service's work slows
    every other's on one host, which no real deployment sees. One CPU: nothing pinned."""
    cpus = sorted(os.sched_getaffinity(0))
    n = len(cpus)
    if n < 2:
        return {}
    if n == 2:
        return {"prefill": cpus[:1], "relay": cpus[1:], "main": cpus[1:]}
    k = n // 3
    return {"prefill": cpus[: n - 2 * k], "relay": cpus[n - 2 * k: n - k], "main": cpus[n - k:]}


class BenchStack:
    """P, RLD, MD, router as `pddjax serve` processes; P and RLD reach MD through the WAN link."""

    def __init__(self, stack: dict, workdir: str, timeout: float = 600.0, pin: bool = True):
        from serving.stack.up import spawn, wait_ready, write_json

        self.children, self.link, self.router_child, self.workdir, self.cpus = [], None, None, workdir, {}
        self.compiles_at_ready: dict[str, dict] = {}
        self.timeout = timeout
        self.log = open(os.path.join(workdir, "services.log"), "ab")
        try:
            cfg = os.path.join(workdir, "stack.json")
            write_json(cfg, stack)
            self.cpus = cluster_cpus() if pin else {}
            self.children = [spawn(r, cfg, workdir, log=self.log, cpus=self.cpus.get(r))
                             for r in ("prefill", "relay", "main")]
            asyncio.run(wait_ready(self.children, timeout))
            compiles.wait_built(self.engines(), timeout)  # a steady state: no background compile beside the steps
            self.compiles_at_ready = compiles.read(self.engines())  # the moment the stack was built
            addr = {c.role: c.address for c in self.children}
            self.link = LinkThread(addr["main"], stack.get("wan", {}))
            rstack = {**stack, "router": {**stack.get("router", {}), "prefill": addr["prefill"],
                                          "relay": addr["relay"], "main": addr["main"], "main_wan": self.link.address}}
            self.router_cfg = os.path.join(workdir, "router.json")
            write_json(self.router_cfg, rstack)
            self.start_router()
        except BaseException:
            self.close()
            raise

    def start_router(self) -> None:
        """(Re)start the router: after the history phase, so its link estimates, session
        tracker and counters start fresh while P's and MD's caches stay warm."""
        from serving.stack.up import spawn, stop_all, wait_ready

        if self.router_child is not None:
            stop_all([self.router_child])
            self.children.remove(self.router_child)
            os.remove(self.router_child.ready_file)
        self.router_child = spawn("router", self.router_cfg, self.workdir, log=self.log)
        self.children.append(self.router_child)
        asyncio.run(wait_ready([self.router_child], self.timeout))
        self.router = self.router_child.address

    def engines(self) -> dict[str, str | None]:
        """The engine services' /metrics URLs, by role (from their ready files)."""
        return {c.role: c.metrics for c in self.children if c.role != "router"}

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system, all threads) each service and this process (the bench
        client and the WAN link) have used so far."""
        out = {c.role: _proc_cpu_s(c.proc.pid) for c in self.children}
        t = os.times()
        out["bench"] = t.user + t.system
        return out

    def close(self) -> None:
        from serving.stack.up import stop_all

        stop_all(self.children)
        if self.link is not None:
            self.link.close()
            self.link = None
        self.log.close()


def _proc_cpu_s(pid: int) -> float:
    got = stat_cpu_s(f"/proc/{pid}/stat")
    return float("nan") if got is None else got[1]
