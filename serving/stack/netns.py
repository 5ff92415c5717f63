"""Two hosts on one machine for `pddjax up --netns` (root; iproute2's `ip` and `tc`).

    this host (root namespace)                cluster A: netns pddjax-<pid>-a        cluster B: netns pddjax-<pid>-b
    pdh<pid> 10.250.1.1/30  <-- veth -->  pdha<pid> 10.250.1.2/30  (router, gateway)
                                          pdwa<pid> 10.250.0.1/30  <-- veth, shaped -->  pdwb<pid> 10.250.0.2/30 (MD)

Cluster A (P, RLD, the router, the OpenAI gateway) and cluster B (MD) each get a network
namespace with its own loopback and addresses; the only way between them is the WAN veth pair,
so KV and handoffs really cross a network interface (its byte counters: `counters`). The line
is shaped by the kernel on both ends: `tc` token bucket (tbf) for the bandwidth and, where the
kernel has the netem qdisc, its delay for the one-way latency (netem at the root, tbf under it).
Without netem (`latency_by_kernel` False) the caller keeps the userspace link for latency only.
The host veth lets clients on this host reach the router and the gateway in cluster A.

Namespaces are named with the owner's pid: `remove_stale()` (run by `create`) deletes those
whose owner is gone (a crashed `up`), and `Topology.close()` deletes this run's. Deleting a
namespace deletes the veth ends in it, and so both pairs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess

from pddjax.errors import UserError

PREFIX = "pddjax-"  # namespaces: pddjax-<pid>-a / -b
WAN_A, WAN_B = "10.250.0.1", "10.250.0.2"  # the WAN veth pair (/30)
HOST_ROOT, HOST_A = "10.250.1.1", "10.250.1.2"  # this host <-> cluster A (/30)
MIN_BURST_BYTES = 64 * 1024  # tbf's bucket: at least a GSO packet, else big packets stall
QUEUE_LATENCY_MS = 1000  # tbf's queue: packets waiting longer are dropped (TCP backs off)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    run = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and run.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {run.stderr.strip()}")
    return run


def tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    run = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=30)
    if check and run.returncode != 0:
        raise OSError(f"tc -n {ns} {' '.join(args)}: {run.stderr.strip()}")
    return run


def not_permitted() -> str | None:
    """Why network namespaces cannot be used here (one sentence), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (run pddjax up --netns as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"network namespaces need iproute2's `{tool}`, which is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    run = ip("netns", "add", probe, check=False)
    if run.returncode != 0:
        return f"`ip netns add` is not permitted here: {run.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces and host veths of ours whose owning process is gone -> their names."""
    gone = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-(a|b|probe)", name)
        if m and not _alive(int(m.group(1))):
            ip("netns", "del", name, check=False)
            gone.append(name)
    for link in json.loads(ip("-j", "link", "show", check=False).stdout or "[]"):
        m = re.fullmatch(r"pdh(\d+)", link.get("ifname", ""))
        if m and not _alive(int(m.group(1))):
            ip("link", "del", link["ifname"], check=False)
            gone.append(link["ifname"])
    return gone


@dataclasses.dataclass
class Topology:
    a: str  # cluster A's namespace
    b: str  # cluster B's namespace
    wan_a: str  # the WAN veth's end in A (KV and handoffs leave A here)
    wan_b: str
    host_dev: str  # this host's end of the veth into A
    mbps: float  # tbf rate each way (0: unshaped)
    latency_ms: float
    latency_by_kernel: bool  # netem delay on both ends; False: the caller adds it in userspace

    def wrap(self, side: str) -> list[str]:
        """The command prefix that runs a process in cluster `side` ("a" or "b")."""
        return ["ip", "netns", "exec", self.a if side == "a" else self.b]

    def counters(self, side: str = "a") -> dict:
        """tx/rx bytes and packets of the WAN veth's end in namespace `side`."""
        ns, dev = (self.a, self.wan_a) if side == "a" else (self.b, self.wan_b)
        (link,) = json.loads(ip("-n", ns, "-j", "-s", "link", "show", "dev", dev).stdout)
        st = link["stats64"]
        return {"tx_bytes": st["tx"]["bytes"], "rx_bytes": st["rx"]["bytes"], "tx_packets": st["tx"]["packets"],
                "rx_packets": st["rx"]["packets"]}

    def describe(self) -> str:
        rate = f"{self.mbps:g} Mb/s (kernel tbf)" if self.mbps else "unlimited"
        if not self.latency_ms:
            delay = "no added latency"
        elif self.latency_by_kernel:
            delay = f"{self.latency_ms:g} ms each way (kernel netem)"
        else:
            delay = f"{self.latency_ms:g} ms each way (userspace link: this kernel has no netem)"
        return f"veth {self.wan_a} {WAN_A} <-> {self.wan_b} {WAN_B}: {rate}, {delay}"

    def state(self) -> dict:
        return {**dataclasses.asdict(self), "wan_addresses": [WAN_A, WAN_B], "host_address": HOST_A,
                "describe": self.describe()}

    def close(self) -> None:
        for ns in (self.a, self.b):
            ip("netns", "del", ns, check=False)
        ip("link", "del", self.host_dev, check=False)  # normally gone with A's end already


def _shape(ns: str, dev: str, mbps: float, latency_ms: float) -> bool:
    """tbf at `mbps` (if > 0) and netem delay (if > 0 and the kernel has it) on `dev`'s egress
    -> whether the delay is the kernel's."""
    tbf = []
    if mbps > 0:
        rate_bytes = mbps * 1e6 / 8
        burst = max(MIN_BURST_BYTES, int(rate_bytes / 100))  # >= 10 ms at the rate
        tbf = ["tbf", "rate", f"{mbps:g}mbit", "burst", str(burst), "latency", f"{QUEUE_LATENCY_MS}ms"]
    if latency_ms > 0:
        netem = tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{latency_ms:g}ms",
                   "limit", "100000", check=False)
        if netem.returncode == 0:
            if tbf:
                tc(ns, "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf)
            return True
    if tbf:
        tc(ns, "qdisc", "add", "dev", dev, "root", *tbf)
    return False


def create(mbps: float = 0.0, latency_ms: float = 0.0) -> Topology:
    """Both namespaces, both veth pairs, addresses, routes and shaping (stale ones removed first)."""
    problem = not_permitted()
    if problem:
        raise UserError(problem)
    remove_stale()
    tag = str(os.getpid())
    topo = Topology(f"{PREFIX}{tag}-a", f"{PREFIX}{tag}-b", f"pdwa{tag}", f"pdwb{tag}", f"pdh{tag}", float(mbps),
                    float(latency_ms), False)
    host_a = f"pdha{tag}"
    try:
        for ns in (topo.a, topo.b):
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("link", "add", topo.wan_a, "type", "veth", "peer", "name", topo.wan_b)
        ip("link", "set", topo.wan_a, "netns", topo.a)
        ip("link", "set", topo.wan_b, "netns", topo.b)
        ip("-n", topo.a, "addr", "add", f"{WAN_A}/30", "dev", topo.wan_a)
        ip("-n", topo.b, "addr", "add", f"{WAN_B}/30", "dev", topo.wan_b)
        ip("link", "add", topo.host_dev, "type", "veth", "peer", "name", host_a)
        ip("link", "set", host_a, "netns", topo.a)
        ip("addr", "add", f"{HOST_ROOT}/30", "dev", topo.host_dev)
        ip("-n", topo.a, "addr", "add", f"{HOST_A}/30", "dev", host_a)
        for ns, dev in ((topo.a, topo.wan_a), (topo.b, topo.wan_b), (topo.a, host_a)):
            ip("-n", ns, "link", "set", dev, "up")
        ip("link", "set", topo.host_dev, "up")
        by_kernel = [_shape(ns, dev, topo.mbps, topo.latency_ms) for ns, dev in ((topo.a, topo.wan_a),
                                                                               (topo.b, topo.wan_b))]
        topo.latency_by_kernel = all(by_kernel) and topo.latency_ms > 0
    except BaseException:
        topo.close()
        raise
    return topo
