"""deploy/'s side of the network, checked against the code so that it cannot drift: every pod is
behind a default-deny ingress policy and its role's NetworkPolicy admits exactly the flows the
code uses (who calls whom: serving/authz.py's table; the ports: the stack config, the metrics
port variable, the gateway's --port); the health port is opened to no pod (kubelet probes from the
pod's node, which a NetworkPolicy always admits); MD across the WAN is admitted from the same
range as its LoadBalancer's source ranges, with the callers' addresses kept; every emptyDir has
a sizeLimit; every pod's grace period exceeds its drain (serving.stack.server.drain_budget).
Skipped, with the reason, where kubectl is missing."""

from __future__ import annotations

import tomllib

import pytest

from serving import authz
from serving.cli import build_parser
from serving.config import service_config
from serving.openai.server import SHUTDOWN_GRACE_S
from serving.stack import probes
from serving.stack.server import drain_budget
from tests.support.kustomize import KUBECTL, kustomizations, of_kind, pods

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: the manifests were not rendered")

ANYONE = ("anyone",)
MONITORING = ("monitoring",)  # Prometheus pods in the monitoring namespace
ROUTER_CLIENTS = ("router-clients",)  # pods labelled pddjax.io/router-client=true, any namespace
ALL_PORTS = None


def source(peer: dict) -> tuple:
    """What one `from` entry of an ingress rule admits, in this test's words (or an AssertionError)."""
    if "ipBlock" in peer:
        assert not peer["ipBlock"].get("except"), peer
        return ("ipBlock", peer["ipBlock"]["cidr"])
    pod, ns = peer.get("podSelector", {}).get("matchLabels", {}), peer.get("namespaceSelector")
    if ns is None and set(pod) == {"app.kubernetes.io/name", "app.kubernetes.io/component"} \
            and pod["app.kubernetes.io/name"] == "pddjax":
        return ("pod", pod["app.kubernetes.io/component"])
    if ns == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}} and \
            pod == {"app.kubernetes.io/name": "prometheus"}:
        return MONITORING
    if ns == {} and pod == {"pddjax.io/router-client": "true"}:
        return ROUTER_CLIENTS
    raise AssertionError(f"an ingress source nothing in the code calls for: {peer}")


def admitted(docs, labels: dict) -> tuple[int, set]:
    """(how many policies select a pod with `labels`, every (source, port) they admit)."""
    selecting, flows = 0, set()
    for name, pol in of_kind(docs, "NetworkPolicy").items():
        if not pol["spec"]["podSelector"].get("matchLabels", {}).items() <= labels.items():
            continue
        assert "Ingress" in pol["spec"]["policyTypes"], name
        selecting += 1
        for rule in pol["spec"].get("ingress", []):
            ports = rule.get("ports", [])
            assert all(p.get("protocol", "TCP") == "TCP" and isinstance(p["port"], int) for p in ports), (name, rule)
            flows |= {(s, p) for s in [source(f) for f in rule.get("from", [])] or [ANYONE]
                      for p in [p["port"] for p in ports] or [ALL_PORTS]}
    return selecting, flows


def wan_ranges(docs) -> list[str]:
    """MD's LoadBalancer source ranges (cluster B), or none."""
    svc = of_kind(docs, "Service").get("pddjax-main")
    return svc["spec"].get("loadBalancerSourceRanges", []) if svc else []


def expected(docs, role: str, container: dict) -> set:
    """The flows the code needs into a `role` pod."""
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    flows = {(MONITORING, int(env[probes.METRICS_PORT_ENV]))}
    if role == "openai":
        return flows | {(ANYONE, build_parser().parse_args(container["args"]).port)}
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("pddjax-stack")]
    port = service_config(tomllib.loads(cm["data"]["stack.toml"]), role, None).port
    if role == "router":  # the gateway (serving/openai/upstream.py) and gRPC clients (serving/client.py)
        return flows | {(("pod", "openai"), port), (ROUTER_CLIENTS, port)}
    callers = frozenset().union(*authz.ALLOWED[role].values())
    here = {r for r, _, _ in pods(docs)}
    flows |= {(("pod", c), port) for c in callers & here}
    if callers - here:  # across the WAN: through MD's LoadBalancer, from cluster A's range
        assert wan_ranges(docs), f"{role}'s callers {sorted(callers - here)} are elsewhere, and no range admits them"
        flows |= {(("ipBlock", cidr), port) for cidr in wan_ranges(docs)}
    if role == "main":  # a multi-host MD's processes: coordinator, op channel, collectives
        flows.add((("pod", "main"), ALL_PORTS))
    return flows


def variants(rendered, lws_rendered) -> dict[str, list[dict]]:
    return {**{k: rendered[k] for k in kustomizations(deployable=True)}, "overlays/cluster-b + lws-main": lws_rendered}


def test_every_pod_admits_exactly_the_flows_the_code_uses(rendered, lws_rendered):
    for name, docs in variants(rendered, lws_rendered).items():
        deny = [p for p in of_kind(docs, "NetworkPolicy").values() if p["spec"]["podSelector"] == {}]
        assert deny and not any(p["spec"].get("ingress") for p in deny), f"{name}: no default-deny ingress policy"
        for role, pod, _ in pods(docs):
            (c,) = pod["spec"]["containers"]
            selecting, flows = admitted(docs, pod["metadata"]["labels"])
            assert selecting >= 2, f"{name}: {role} has no NetworkPolicy of its own"
            assert flows == expected(docs, role, c), f"{name}: {role}"
            health = {p["containerPort"] for p in c["ports"] if p["name"] == "health"}
            assert not {p for _, p in flows} & health, f"{name}: {role}'s health port is open to pods"


def test_md_across_the_wan_keeps_its_callers_addresses(rendered):
    docs = rendered["overlays/cluster-b"]
    svc = of_kind(docs, "Service")["pddjax-main"]
    assert svc["spec"]["type"] == "LoadBalancer" and wan_ranges(docs)
    assert svc["spec"].get("externalTrafficPolicy") == "Local"  # else the pod sees a node's address


def test_every_empty_dir_has_a_size_limit(rendered, lws_rendered):
    for name, docs in variants(rendered, lws_rendered).items():
        for role, pod, kind in pods(docs):
            unbounded = [v["name"] for v in pod["spec"]["volumes"] if "emptyDir" in v
                         and not (v["emptyDir"] or {}).get("sizeLimit")]
            assert not unbounded, f"{name}: {role} ({kind}) emptyDir without sizeLimit: {unbounded}"


def test_every_grace_period_exceeds_its_drain(rendered, lws_rendered):
    for name, docs in variants(rendered, lws_rendered).items():
        for role, pod, kind in pods(docs):
            drain = SHUTDOWN_GRACE_S if role == "openai" else drain_budget(openai=role == "router")
            grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
            assert grace > drain, f"{name}: {role} ({kind}) grace {grace} s <= its drain {drain} s"
