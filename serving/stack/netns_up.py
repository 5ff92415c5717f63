"""`pddjax up --netns`: the stack as two hosts on this machine (serving/stack/netns.py).

Cluster A's namespace runs P and RLD (on its loopback), the router (every address of A, so
this host reaches it at netns.HOST_A) with the OpenAI gateway in its process (on HOST_A); cluster B's runs MD
on netns.WAN_B. P's KV and RLD's handoffs to MD, and the router's RPCs to MD, cross the shaped
WAN veth pair. The bandwidth is the kernel's (tbf); the latency too where the kernel has netem,
else a userspace link (`python -m serving.stack.netns_up link`, in cluster A, latency only) sits
in front of each MD as P reaches it (`main_wan`), as in plain `pddjax up`. Off loopback the
services listen in plaintext (`insecure` in their tables: the namespaces' addresses are reached
only from this host) unless a TLS directory is given (--tls / --tls-dir). The state file is
`pddjax up`'s plus `netns` (namespaces, devices, addresses, shaping; `Topology.state`). On stop
(and after a crash, at the next start: netns.remove_stale) the namespaces are deleted, and the
run's folder as `pddjax up`'s (`up.end_workdir`: kept after a failure for its log, never its copies
of the TLS keys or the token). Only the
namespaces are made as root: every service (and the link) runs as an unprivileged user
(serving/stack/netns_user.py: setpriv after `ip netns exec`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile

from pddjax.env import DIE_WITH_PARENT, TLS_DIR
from serving.config import ENGINE_ROLES
from serving.stack import netns, netns_user
from serving.stack.up import (
    Child,
    cohosted_openai_args,
    end_workdir,
    openai_state,
    ready_unless_stopped,
    spawn,
    stop_all,
    stop_on_signals,
    supervise_until_stopped,
    wait_ready,
    write_json,
)


def cluster_stack(stack: dict) -> dict:
    """Each role's host in its namespace; plaintext allowed there (reached from this host only)."""
    hosts = {"prefill": "127.0.0.1", "relay": "127.0.0.1", "main": netns.WAN_B, "router": "0.0.0.0"}
    return {**stack, **{r: {**stack.get(r, {}), "host": h, "insecure": True} for r, h in hosts.items()}}


def spawn_link(wrap: list[str], target: str, latency_ms: float, workdir: str, k: int, log) -> Child:
    """A latency-only userspace link in cluster A (behind `wrap`) in front of MD `target` (no netem here)."""
    ready = os.path.join(workdir, f"wan{k}.ready.json")
    cmd = [*wrap, sys.executable, "-m", "serving.stack.netns_up", "link", "--target", target,
           "--latency-ms", str(latency_ms), "--port", "0", "--ready-file", ready]
    env = {**os.environ, DIE_WITH_PARENT.name: "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
    return Child("wan", proc, ready, cmd, env, log)


async def run_netns_stack(stack: dict, port: int, state_file: str | None, instances: tuple[int, int, int] = (1, 1, 1),
                          openai_port: int = 0, service_user: str = netns_user.SERVICE_USER) -> int:
    wan = stack.get("wan", {})
    mbps, latency_ms = float(wan.get("mbps", 0) or 0), float(wan.get("latency_ms", 0) or 0)
    topo = netns.create(mbps, latency_ms)
    workdir = tempfile.mkdtemp(prefix="pddjax-up-netns-")
    children: list[Child] = []
    stop = stop_on_signals()
    log = open(os.path.join(workdir, "services.log"), "ab")
    rc = None
    try:
        user = netns_user.prepare(workdir, service_user)  # the services' user (the namespaces needed root)
        if user.uid == 0:
            print("pddjax up --netns: warning: the services run as root (--netns-user root)", file=sys.stderr,
                  flush=True)

        def wrap(side: str) -> list[str]:
            return [*topo.wrap(side), *user.prefix()]

        peers_file = os.path.join(workdir, "prefill-kv-peers.json")
        stack = cluster_stack(stack)
        stack["prefill"]["kv_peers_file"] = peers_file
        cfg_path = os.path.join(workdir, "stack.json")
        write_json(cfg_path, stack)
        children = [spawn(r, cfg_path, workdir, log=log, name=f"{r}{k}", wrap=wrap("b" if r == "main" else "a"))
                    for r, n in zip(ENGINE_ROLES, instances) for k in range(n)]
        if not await ready_unless_stopped(children, stop):
            rc = 130
            return rc
        addr = {r: [c.address for c in children if c.role == r] for r in ENGINE_ROLES}
        wan_addrs = list(addr["main"])  # P -> MD straight over the veth, unless latency needs the userspace link
        if latency_ms and not topo.latency_by_kernel:
            links = [spawn_link(wrap("a"), a, latency_ms, workdir, k, log) for k, a in enumerate(addr["main"])]
            await wait_ready(links, timeout=60)
            children += links
            wan_addrs = [lk.address for lk in links]
        write_json(peers_file, [*addr["relay"], *wan_addrs])
        rstack = {**stack, "router": {**stack["router"], "prefill": addr["prefill"], "relay": addr["relay"],
                                      "main": addr["main"], "main_wan": wan_addrs}}
        rcfg = os.path.join(workdir, "router.json")
        write_json(rcfg, rstack)
        router = spawn("router", rcfg, workdir, port=port, log=log, wrap=wrap("a"),
                       args=cohosted_openai_args(openai_port, netns.HOST_A))  # the gateway in the router's process
        children.append(router)
        await wait_ready([router], timeout=120)
        router_port = router.address.rsplit(":", 1)[1]
        public = f"{netns.HOST_A}:{router_port}"
        gateway = openai_state(router)

        def state():
            where = {"prefill": topo.a, "relay": topo.a, "router": topo.a, "wan": topo.a, "main": topo.b}
            return {"services": [{"role": c.role, "pid": c.proc.pid, "address": c.address, "metrics": c.metrics,
                                  "netns": where[c.role]} for c in children],
                    "router": public, "wan": {"address": wan_addrs[0], "target": addr["main"][0], "mbps": mbps,
                                              "latency_ms": latency_ms},
                    "netns": {**topo.state(), "counters_a": topo.counters("a")}, "log": log.name,
                    **gateway, "openai_service": {**gateway["openai_service"], "pid": router.proc.pid},
                    "tls_dir": TLS_DIR.get()}

        if state_file:
            write_json(state_file, state())
        counts = ", ".join(f"{n} {r}" for r, n in zip(ENGINE_ROLES, instances))
        print(f"pddjax up --netns: router on {public} ({counts}); cluster A = netns {topo.a} (P, RLD, router, "
              f"gateway), cluster B = netns {topo.b} (MD); {topo.describe()}", flush=True)
        print(f"pddjax up --netns: OpenAI-compatible API on {gateway['openai']} (in the router's process)", flush=True)
        rc = await supervise_until_stopped(stop, children, state_file, state)
        return rc
    finally:
        stop_all(children)
        log.close()
        topo.close()
        if state_file and os.path.exists(state_file):
            os.remove(state_file)
        end_workdir(workdir, rc)


# ---- the latency-only userspace link, run inside cluster A ------------------------------
async def _link(target: str, latency_ms: float, port: int, ready_file: str) -> None:
    from serving.stack.wanlink import WanLink

    host, tport = target.rsplit(":", 1)
    link = WanLink(host, int(tport), 0.0, latency_ms)
    address = await link.start("127.0.0.1", port)
    write_json(ready_file, {"role": "wan", "pid": os.getpid(), "address": address})
    await stop_on_signals().wait()
    await link.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serving.stack.netns_up")
    sub = p.add_subparsers(dest="command", required=True)
    lk = sub.add_parser("link", help="a latency-only userspace A -> B link (for a kernel without netem)")
    lk.add_argument("--target", required=True)
    lk.add_argument("--latency-ms", type=float, required=True)
    lk.add_argument("--port", type=int, default=0)
    lk.add_argument("--ready-file", required=True)
    args = p.parse_args(argv)
    if DIE_WITH_PARENT.get():
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: ends with `up`
    asyncio.run(_link(args.target, args.latency_ms, args.port, args.ready_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
