"""`pddjax up`: the whole stack on this machine as separate processes.

Cluster A: P and RLD; cluster B: MD; the router on --port. `--instances P,R,M` starts several
of each (the router balances them). P and RLD reach each MD only through its own WanLink
(bandwidth and latency), running in this supervisor process. Steps: write each service's
config, start the P, RLD, MD instances (`pddjax serve ROLE`), wait for their ready files,
start the links, start the router (given every address: MD's `main` and, as `main_wan`, its
link's; the router is not told the link's rate unless `[router] wan_mbps` or
`--wan-capacity-mbps` says so: it probes the link it is given, as in a real deployment), start
the OpenAI-compatible gateway with it, in the router's process (`serve router --openai-port`,
`up --openai-port`), write the state file
  {"services": [{"role", "pid", "address", "metrics" (its /metrics URL), "startup" (its phases)}],
   "wan": {...}, "wans": [...],
   "router": ADDRESS, "openai": "http://HOST:PORT/v1", "openai_service": {"pid" (the router's), "address", "metrics"},
   "tls_dir": the TLS directory or null (clients need its ca.pem)}
P may push KV only to RLD and the links (`[prefill] kv_peers_file`, written once they listen).
(`wan` is the first MD's link; byte counters refreshed every second), print the router
address, and on Ctrl-C or SIGTERM stop every child (SIGTERM, then SIGKILL after a grace
period). A service that exits is started again on its port after a backoff
(`supervise.Supervisor`); the stack stops only when a role has no instance left that runs
or will run again (one exiting more than 5 times in 5 minutes is given up). The run's folder
(configs, ready files, `services.log`, the state's `log`) is removed after a stop asked for
(Ctrl-C, SIGTERM); after a failure its log stays for a look (`end_workdir`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from pddjax.env import CPUS, DIE_WITH_PARENT, READY_SECONDS, TLS_DIR
from pddjax.errors import UserError
from serving.config import ENGINE_ROLES
from serving.stack.netns_user import SECRET_COPIES
from serving.stack.supervise import Supervisor
from serving.stack.wanlink import WanLink


class Child:
    """One service process; `relaunch()` starts the same command again on the port it had."""

    def __init__(self, role: str, proc: subprocess.Popen, ready_file: str, cmd: list[str] | None = None,
                 env: dict | None = None, log=None):
        self.role, self.proc, self.ready_file = role, proc, ready_file
        self.cmd, self.env, self.log = cmd, env, log
        self.address: str | None = None
        self.metrics: str | None = None  # its Prometheus endpoint (from the ready file)
        self.startup: dict | None = None  # where its start went (the ready file's `startup`: startup_clock.py)
        self.restarting = False  # relaunched, not ready yet (supervise.py)

    def read_ready(self) -> None:
        with open(self.ready_file) as f:
            ready = json.load(f)
        self.address, self.metrics, self.startup = ready["address"], ready.get("metrics"), ready.get("startup")

    def relaunch(self) -> None:
        """The same command with `--port` set to the port it listened on (peers keep its address)."""
        if self.cmd is None:
            raise OSError(f"the {self.role} service was not started with a command to repeat")
        cmd = list(self.cmd)
        if self.address and "--port" in cmd:
            cmd[cmd.index("--port") + 1] = self.address.rsplit(":", 1)[1]
        if os.path.exists(self.ready_file):
            os.remove(self.ready_file)
        self.proc = subprocess.Popen(cmd, stdout=self.log or subprocess.DEVNULL, stderr=self.log or None,
                                     env=self.env)
        self.restarting, self.metrics = True, None


def spawn(role: str, config_path: str, workdir: str, port: int = 0, log=None, name: str | None = None,
          cpus: list[int] | None = None, wrap: list[str] | None = None, args: tuple[str, ...] = ()) -> Child:
    """Start `pddjax serve ROLE [args]` (pinned to `cpus` if given; behind `wrap`, e.g. `ip netns exec NS`
    for `up --netns`: serving/stack/netns.py); its address comes via the ready file."""
    ready = os.path.join(workdir, f"{name or role}.ready.json")
    cmd = [*(wrap or []), sys.executable, "-m", "serving", "serve", role, "--config", config_path, "--port", str(port),
           "--ready-file", ready, *args]
    env = {**os.environ, DIE_WITH_PARENT.name: "1"}
    if cpus:
        env[CPUS.name] = ",".join(map(str, cpus))
    proc = subprocess.Popen(cmd, stdout=log or subprocess.DEVNULL, stderr=log or None, env=env)
    return Child(role, proc, ready, cmd, env, log)


PROGRESS_SECONDS = 20.0  # a line on the services still starting, this often


async def wait_ready(children: list[Child], timeout: float | None = None) -> None:
    """Every child's address from its ready file, within `timeout` s (default PDDJAX_READY_SECONDS:
    each service precompiles its step shape set first, tens of seconds from a warm compile cache,
    minutes on a fresh machine: about 5 min for the real model's 110 variants on 2 loaded cores)."""
    t0 = time.monotonic()
    timeout = READY_SECONDS.get() if timeout is None else timeout
    said = t0
    while any(c.address is None for c in children):
        for c in children:
            if c.address is None and os.path.exists(c.ready_file):
                c.read_ready()
                print(f"pddjax up: {c.role} ready after {time.monotonic() - t0:.0f} s{built(c.startup)}", flush=True)
            if c.proc.poll() is not None and c.address is None:
                raise UserError(f"the {c.role} service exited with code {c.proc.returncode} while starting")
        if time.monotonic() - t0 > timeout:
            raise UserError(f"services did not become ready within {timeout:.0f} s")
        if time.monotonic() - said > PROGRESS_SECONDS:
            said = time.monotonic()
            waiting = ", ".join(c.role for c in children if c.address is None)
            print(f"pddjax up: {waiting} still loading and compiling ({said - t0:.0f} s; a cold compile cache "
                  f"takes longest)", flush=True)
        await asyncio.sleep(0.1)


def built(startup: dict | None) -> str:
    """', 6 of 110 step shapes built (104 more in the background)' from a service's `startup`."""
    if not startup or "stated" not in startup:
        return ""
    rest = startup.get("background_total", 0)
    return (f", {startup['shapes']} of {startup['stated']} step shapes built"
            + (f" ({rest} more in the background)" if rest else ""))


def stop_all(children: list[Child], grace: float = 5.0) -> None:
    for c in children:
        if c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def stop_on_signals() -> asyncio.Event:
    """An event SIGTERM and SIGINT set (the stack stops on it)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def ready_unless_stopped(children: list[Child], stop: asyncio.Event) -> bool:
    """`wait_ready(children)` (its error if a child fails), unless `stop` is set first: False."""
    waiter, stopped = asyncio.create_task(wait_ready(children)), asyncio.create_task(stop.wait())
    await asyncio.wait([waiter, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if stop.is_set():
        waiter.cancel()
        return False
    await waiter
    return True


def end_workdir(workdir: str, rc: int | None) -> None:
    """A stopped stack's run folder: removed after a stop asked for (rc 0, or 130 while starting);
    after a failure (any other rc, or an exception: rc None) kept for its services' log, less
    any copy of a secret."""
    if rc in (0, 130):
        shutil.rmtree(workdir, ignore_errors=True)
        return
    for name in SECRET_COPIES:
        path = os.path.join(workdir, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)
    print(f"pddjax up: the services' log is kept in {os.path.join(workdir, 'services.log')}", file=sys.stderr,
          flush=True)


async def run_stack(stack: dict, port: int, state_file: str | None, quiet: bool = False,
                    instances: tuple[int, int, int] = (1, 1, 1), openai_port: int = 0) -> int:
    workdir = tempfile.mkdtemp(prefix="pddjax-up-")
    children: list[Child] = []
    links: list[WanLink] = []
    stop = stop_on_signals()
    log = open(os.path.join(workdir, "services.log"), "ab")
    rc = None
    try:
        cfg_path = os.path.join(workdir, "stack.json")
        peers_file = os.path.join(workdir, "prefill-kv-peers.json")  # where P may push KV: written below
        stack = {**stack, "prefill": {**stack.get("prefill", {}), "kv_peers_file": peers_file}}
        write_json(cfg_path, stack)
        children = [spawn(r, cfg_path, workdir, log=log, name=f"{r}{k}")
                    for r, n in zip(ENGINE_ROLES, instances) for k in range(n)]
        if not await ready_unless_stopped(children, stop):
            rc = 130
            return rc
        addr = {r: [c.address for c in children if c.role == r] for r in ENGINE_ROLES}
        wan = stack.get("wan", {})
        wan_addrs = []
        for a in addr["main"]:
            links.append(WanLink.from_settings(a, wan))  # bandwidth, latency, jitter, trace, stalls
            wan_addrs.append(await links[-1].start(stack.get("host", "127.0.0.1")))
        write_json(peers_file, [*addr["relay"], *wan_addrs])  # P's KV peers: RLD, and MD through its link
        rstack = {**stack, "router": {**stack.get("router", {}), "prefill": addr["prefill"], "relay": addr["relay"],
                                      "main": addr["main"], "main_wan": wan_addrs}}
        rcfg = os.path.join(workdir, "router.json")
        write_json(rcfg, rstack)
        router = spawn("router", rcfg, workdir, port=port, log=log, args=cohosted_openai_args(openai_port))
        children.append(router)
        await wait_ready([router], timeout=120)
        gateway = openai_state(router)
        link = links[0]

        def state():
            wans = [{"address": w, "target": a, **lk.stats()} for w, a, lk in zip(wan_addrs, addr["main"], links)]
            return {"services": [{"role": c.role, "pid": c.proc.pid, "address": c.address, "metrics": c.metrics,
                                  "startup": c.startup} for c in children],
                    "router": router.address, "wan": wans[0], "wans": wans, "log": log.name, **gateway,
                    "openai_service": {**gateway["openai_service"], "pid": router.proc.pid},  # after a restart too
                    "tls_dir": TLS_DIR.get()}

        if state_file:
            write_json(state_file, state())
        counts = ", ".join(f"{n} {r}" for r, n in zip(ENGINE_ROLES, instances))
        print(f"pddjax up: router on {router.address} ({counts}; WAN link {wan_addrs[0]} -> MD {addr['main'][0]}, "
              f"{link.mbps or 'unlimited'} Mb/s, {link.latency_ms} ms, KV wire "
              f"{stack.get('router', {}).get('kv_wire') or wan.get('kv_wire', 'native')})", flush=True)
        print(f"pddjax up: OpenAI-compatible API on {gateway['openai']} (in the router's process)", flush=True)
        rc = await supervise_until_stopped(stop, children, state_file, state)
        return rc
    finally:
        for lk in links:
            await lk.close()
        stop_all(children)
        log.close()
        if state_file and os.path.exists(state_file):
            os.remove(state_file)
        end_workdir(workdir, rc)


# ---- the OpenAI-compatible HTTP gateway (serving/openai), in the router's process ---------
def cohosted_openai_args(port: int, host: str | None = None) -> tuple[str, ...]:
    """`pddjax serve router`'s flags for the co-hosted gateway (its host: the router's unless given)."""
    return ("--openai-port", str(port), *(("--openai-host", host) if host else ()))


def openai_state(router: Child) -> dict:
    """The state file's `openai` (base URL) and `openai_service` (pid, address, metrics: the
    router's process) from the ready router's ready file. Its port is pinned in the router's
    command, so a restarted router serves the gateway where clients know it."""
    with open(router.ready_file) as f:
        gw = json.load(f)["openai"]
    if router.cmd is not None and "--openai-port" in router.cmd:
        router.cmd[router.cmd.index("--openai-port") + 1] = gw["address"].rsplit(":", 1)[1]
    return {"openai": gw["url"], "openai_service": {"pid": router.proc.pid, "address": gw["address"],
                                                    "metrics": gw["metrics"]}}


async def supervise_until_stopped(stop: asyncio.Event, children: list, state_file: str | None, state) -> int:
    """Until `stop` is set: restart a service that exits (supervise.py) and rewrite the state file
    (`state()`) every second. -> 1 when a role has no service left, 0 once stopped."""
    supervisor = Supervisor(children)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except TimeoutError:
            pass
        gone = supervisor.poll()
        if gone:
            print(f"pddjax up: no {gone[0]} service is left; stopping", file=sys.stderr, flush=True)
            return 1
        if state_file:
            write_json(state_file, state())
    return 0
