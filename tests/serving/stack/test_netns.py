"""`pddjax up --netns`: cluster A (P, RLD, router, gateway) and cluster B (MD) in their own
network namespaces, joined by a kernel-shaped veth pair (serving/stack/netns.py). One stack
start (tiny model): a pdd request through the router is token-exact against the monolithic
reference and hands over to MD, and the WAN veth's interface counters show at least the
request's KV crossing A -> B (so KV really crossed a network interface, not a loopback
proxy). Also: every service runs unprivileged (uid, gid, groups and capabilities not root's),
a stale namespace of a dead `up` is removed at start, and every namespace is gone after the
stack stops. Skipped, with the reason, where namespaces are not permitted."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from pddjax.engines.reference import ReferenceEngine
from pddjax.errors import UserError
from pddjax.model.sampling_params import SamplingParams
from serving.client import Client, make_request
from serving.stack import netns, netns_user
from tests.support.paths import CONFIGS
from tests.support.serving_stack import launch_up, pid_alive

PROBLEM = netns.not_permitted() if os.name == "posix" else "not Linux"
pytestmark = [pytest.mark.skipif(PROBLEM is not None, reason=f"network namespaces not permitted: {PROBLEM}"),
              pytest.mark.timeout(400)]
WAN_MBPS = 50
PROMPT_TOKENS, MAX_TOKENS, TRIES = 300, 200, 4


def _nobody_cannot_run_this_python() -> str | None:
    """Why the default services' user cannot run this interpreter (e.g. a Python under /root), or None."""
    if PROBLEM is not None:
        return PROBLEM
    import pwd

    pw = pwd.getpwnam(netns_user.SERVICE_USER)
    return netns_user.probe(netns_user.ServiceUser(pw.pw_uid, pw.pw_gid, {"HOME": "/"}))


NOBODY_PROBLEM = _nobody_cannot_run_this_python()


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()}


@pytest.fixture(scope="module")
def stale():
    """A namespace named like one of a crashed `up` (its pid is dead)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{netns.PREFIX}{dead.pid}-a"
    subprocess.run(["ip", "netns", "add", name], check=True)
    yield name
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def start_up(request, workdir):
    """The `up` fixture's stack (tests/serving/conftest.py), started after `stale` was made."""
    request.getfixturevalue("stale")
    user = "root" if NOBODY_PROBLEM else netns_user.SERVICE_USER  # (this Python must be readable by the user)
    return launch_up(workdir, os.path.join(CONFIGS, "tiny.toml"), "--netns", "--wan-mbps", str(WAN_MBPS),
                     "--wan-latency-ms", "2", "--netns-user", user, timeout=300)


def topology(state: dict) -> netns.Topology:
    n = state["netns"]
    return netns.Topology(**{f.name: n[f.name] for f in dataclasses.fields(netns.Topology)})


def test_clusters_in_their_own_namespaces_on_a_shaped_veth(up, stale):
    s = up.read_state()
    topo = topology(s)
    assert stale not in namespaces()  # removed at start: its owner is gone
    assert {topo.a, topo.b} <= namespaces()
    where = {x["role"]: x["netns"] for x in s["services"]}
    assert where["main"] == topo.b and {where[r] for r in ("prefill", "relay", "router")} == {topo.a}
    assert all(pid_alive(x["pid"]) for x in s["services"])
    assert s["services"][[x["role"] for x in s["services"]].index("main")]["address"].startswith(netns.WAN_B + ":")
    qdisc = subprocess.run(["tc", "-n", topo.a, "qdisc", "show", "dev", topo.wan_a], capture_output=True, text=True,
                           check=True).stdout
    assert f"rate {WAN_MBPS}Mbit" in qdisc, qdisc
    print(f"netns: {topo.describe()}")


def status_of(pid: int) -> dict[str, list[str]]:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.split() for k, _, v in (line.partition(":") for line in f)}


@pytest.mark.skipif(NOBODY_PROBLEM is not None, reason=f"{netns_user.SERVICE_USER} cannot run this Python "
                                                         f"(the stack ran with --netns-user root): {NOBODY_PROBLEM}")
def test_services_run_unprivileged(up):
    """Only the namespaces need root: every service (uid, gid, groups, capabilities) does not."""
    services = up.read_state()["services"]
    assert {x["role"] for x in services} >= {"prefill", "relay", "main", "router"}
    for x in services:
        st = status_of(x["pid"])
        assert "0" not in st["Uid"] and "0" not in st["Gid"], (x["role"], st["Uid"], st["Gid"])
        assert "0" not in st["Groups"] and int(st["CapEff"][0], 16) == 0 == int(st["CapPrm"][0], 16), x["role"]
        assert st["NoNewPrivs"] == ["1"], x["role"]


def test_a_user_who_cannot_run_this_python_is_refused_before_any_service_starts(tmp_path):
    """An interpreter in a folder the services' user cannot read (mode 0700, root's): one sentence
    that names the interpreter and the way out, and no folder of the run is handed over."""
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    python = hidden / "python3"
    python.symlink_to(os.path.realpath(sys.executable))
    workdir = tmp_path / "run"
    workdir.mkdir()
    with pytest.raises(UserError, match=r"cannot run this Python \(.*private/python3\).*--netns-user root"):
        netns_user.prepare(str(workdir), home=str(tmp_path / "home"), python=str(python))
    assert os.stat(workdir).st_uid == 0 and not (tmp_path / "home").exists()


def test_pdd_across_the_namespaces_is_exact_and_its_kv_crosses_the_veth(up, tiny):
    """Every try: token-exact, and the WAN veth carried at least the prompt's KV A -> B. RLD may
    finish a request alone before MD has its KV (correct, no handoff to see), so fresh prompts of
    the same shape are tried until one hands over to MD (at most TRIES)."""
    s = up.read_state()
    topo = topology(s)
    ref, client, c = ReferenceEngine(tiny.config, tiny.weights), Client(s["router"]), tiny.config
    kv_bytes = 2 * c.num_layers * PROMPT_TOKENS * c.num_kv_heads * c.head_dim * 4  # K and V, float32 (tiny.toml)
    for attempt in range(TRIES):
        p = np.random.default_rng(7 + attempt).integers(3, 512, PROMPT_TOKENS).tolist()
        before_a, before_b = topo.counters("a"), topo.counters("b")
        r = client.generate(make_request(p, max_tokens=MAX_TOKENS, pipeline="pdd", ignore_eos=True), timeout=120)
        after_a, after_b = topo.counters("a"), topo.counters("b")
        assert r.pipeline == "pdd"
        assert r.token_ids == ref.generate(p, SamplingParams(), MAX_TOKENS, ()).token_ids, r.explain
        sent, received = after_a["tx_bytes"] - before_a["tx_bytes"], after_b["rx_bytes"] - before_b["rx_bytes"]
        print(f"netns try {attempt}: KV of {PROMPT_TOKENS} tokens = {kv_bytes} B; the WAN veth carried {sent} B "
              f"A -> B ({received} B received in B), {after_a['rx_bytes'] - before_a['rx_bytes']} B B -> A; "
              f"handoff chunks {r.usage.get('handoff_chunks')}, switch at {r.timings.get('handoff_position')}")
        assert sent >= kv_bytes and received >= kv_bytes
        if "main" in r.sources:
            break
    assert r.sources[0] == "relay" and r.sources[-1] == "main", (r.usage, r.timings)  # RLD's tokens -> MD in B
    router = next(x for x in s["services"] if x["role"] == "router")
    url = router["metrics"].replace("0.0.0.0", netns.HOST_A)  # the router listens on every address of A
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    gaps = re.search(r"^pddjax_router_handoff_gap_seconds_count (\S+)$", text, re.M)
    assert gaps and float(gaps.group(1)) >= 1, "the switch to MD was not timed"
    link = re.search(r'^pddjax_router_link_mbps\{main="' + re.escape(netns.WAN_B) + r':\d+"\} (\S+)$', text, re.M)
    assert link and 0 < float(link.group(1)) <= WAN_MBPS * 1.1, "no link estimate to MD, or above the tbf rate"
    print(f"netns: router's link estimate {float(link.group(1)):.1f} Mb/s (tbf {WAN_MBPS}), handoff gaps timed "
          f"{gaps.group(1)}")


def test_stopping_deletes_the_namespaces(up):
    state = up.read_state()
    topo = topology(state)
    assert up.close() == 0
    assert not os.path.exists(os.path.dirname(state["log"]))  # the run's folder, with its copies of secrets
    assert not {topo.a, topo.b} & namespaces()
    links = json.loads(subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True).stdout)
    assert topo.host_dev not in {lk["ifname"] for lk in links}
