"""deploy/: every kustomization renders (`kubectl kustomize`), and what it renders matches what
the services use, read from the code: the `pddjax serve` command line (the CLI's own parser),
the stack config (serving.config.service_config on the ConfigMap's TOML), each role's gRPC port,
its grpc.health.v1 service name (serving.stack.server.SERVICES), the probe and metrics ports
(serving.stack.probes' environment variables), the TLS files of each role (what `pddjax certs`
writes, read through serving.security's environment variables) and the cross-cluster addresses.
Skipped, with the reason, where kubectl is missing."""

from __future__ import annotations

import os
import tomllib
from unittest import mock

import pytest

from pddjax import env
from serving import security
from serving.certs import make_dev_certs
from serving.cli import build_parser
from serving.config import ENGINE_ROLES, service_config
from serving.openai.server import plaintext_problem
from serving.stack import probes
from serving.stack.server import SERVICES, drain_budget
from tests.support.kustomize import DEPLOY, KUBECTL, kustomizations, of_kind, pods, render

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: the manifests were not rendered")


def stack_of(docs) -> dict:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("pddjax-stack")]
    return tomllib.loads(cm["data"]["stack.toml"])


def env_of(container) -> dict:
    names = [e["name"] for e in container.get("env", [])]
    assert len(names) == len(set(names)), f"duplicate env in {names}"
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def ports_of(container) -> dict:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def mounted(pod: dict, container: dict, path: str) -> tuple[dict, str]:
    """(the volume, the file name inside it) that `path` names in `container`."""
    for m in container["volumeMounts"]:
        if os.path.dirname(path) == m["mountPath"].rstrip("/"):
            (vol,) = [v for v in pod["volumes"] if v["name"] == m["name"]]
            return vol, os.path.basename(path)
    raise AssertionError(f"{path} is on no volume of {container['name']}")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> set[str]:
    """The file names `pddjax certs` writes."""
    return {os.path.basename(f) for f in make_dev_certs(str(tmp_path_factory.mktemp("certs")), ("localhost",), 1)}


def tls_files(role: str, written: set[str]) -> set[str]:
    """The files of `written` that `role`'s process reads (serving.security)."""
    need = {"ca.pem", security.cert_file(role), security.key_file(role)}
    assert need <= written, (need, written)
    return need


def serve_args(container, index: int = 0, size: int = 2) -> object:
    """The container's command parsed by the CLI (LWS's variables as the LWS controller sets them)."""
    args = [a.replace("$(LWS_LEADER_ADDRESS)", "pddjax-main-0.pddjax-main").replace("$(LWS_GROUP_SIZE)", str(size))
            .replace("$(LWS_WORKER_INDEX)", str(index)) for a in container["args"]]
    return build_parser().parse_args(args)


def check_grpc_pod(role: str, pod: dict, kind: str, stack: dict, written) -> None:
    spec = pod["spec"]
    (c,) = spec["containers"]
    args = serve_args(c, index=int(kind == "worker"))
    assert (args.command, args.role) == ("serve", role)
    cfg = service_config(stack, role, None)  # the ConfigMap's keys, checked as the service checks them
    if getattr(args, "coordinator", None):  # a multi-host group: the flags as `pddjax serve` applies them
        from serving.cli.serve import _apply_multihost_flags

        with mock.patch.dict(os.environ, {security.TLS_DIR_ENV: env_of(c).get(security.TLS_DIR_ENV, "")}):
            _apply_multihost_flags(args, cfg)  # (across hosts the op channel needs the pod's TLS directory)
        assert cfg.num_processes > 1 and cfg.process_id == int(kind == "worker")
        assert ports_of(c)["coordinator"] == int(cfg.coordinator_address.rsplit(":", 1)[1])
    vol, key = mounted(spec, c, args.config)
    assert key in {i.get("key", key) for i in vol["configMap"].get("items", [{"key": key}])}
    env, ports = env_of(c), ports_of(c)
    assert ports["grpc"] == cfg.port != 0
    assert cfg.host == "0.0.0.0"  # the pod's own IP: reachable by its Service
    assert int(env[probes.METRICS_PORT_ENV]) == ports["metrics"] == int(pod["metadata"]["annotations"]
                                                                        ["prometheus.io/port"])
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    tls_vol, _ = mounted(spec, c, os.path.join(env[security.TLS_DIR_ENV], "ca.pem"))
    assert tls_vol["secret"]["secretName"] == f"pddjax-tls-{role}"
    assert {i["key"] for i in tls_vol["secret"]["items"]} == tls_files(role, written)
    assert {i["path"] for i in tls_vol["secret"]["items"]} == tls_files(role, written)
    assert spec["terminationGracePeriodSeconds"] > drain_budget(openai=role == "router"), role  # its whole drain
    if role == "router":
        tok_vol, name = mounted(spec, c, env[security.TOKEN_FILE_ENV])
        assert name in {i["path"] for i in tok_vol["secret"]["items"]}
    if kind == "worker":  # a multi-host group's other processes: no gRPC clients, no probes
        assert not any(k in c for k in ("startupProbe", "readinessProbe", "livenessProbe"))
        return
    health = int(env[probes.HEALTH_PORT_ENV])
    assert ports["health"] == health
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": health, "service": SERVICES[role].full_name}, probe
    assert c["livenessProbe"]["grpc"]["port"] == health
    assert c["livenessProbe"]["grpc"].get("service", "") == ""  # the overall status


def check_services(docs) -> None:
    """Every Service selects a pod and targets ports that pod names; every PDB selects a pod."""
    pod_list = list(pods(docs))
    for name, svc in of_kind(docs, "Service").items():
        sel = svc["spec"]["selector"]
        matching = [p for _, p, kind in pod_list if kind != "worker" and sel.items() <= p["metadata"]["labels"].items()]
        assert matching, f"Service {name} selects no pod"
        for port in svc["spec"]["ports"]:
            assert all(port["targetPort"] in ports_of(p["spec"]["containers"][0]) for p in matching), (name, port)
    for name, pdb in of_kind(docs, "PodDisruptionBudget").items():
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(sel.items() <= p["metadata"]["labels"].items() for _, p, _ in pod_list), name


def service_address(docs, role: str) -> str:
    svc = of_kind(docs, "Service")[f"pddjax-{role}"]
    (port,) = [p["port"] for p in svc["spec"]["ports"] if p["name"] in ("grpc", "http")]
    return f"{svc['metadata']['name']}:{port}"


def test_every_kustomization_renders(rendered):
    assert {"base", "overlays/cluster-a", "overlays/cluster-b"} <= set(kustomizations(deployable=True))
    for name in kustomizations(deployable=True):
        docs = rendered[name]
        kinds = {d["kind"] for d in docs}
        assert {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap"} <= kinds, name


@pytest.mark.parametrize("name", kustomizations(deployable=True))
def test_ports_probes_config_and_secrets_match_the_code(rendered, name, written):
    docs = rendered[name]
    stack = stack_of(docs)
    roles = set()
    for role, pod, kind in pods(docs):
        roles.add(role)
        if role == "openai":
            continue
        check_grpc_pod(role, pod, kind, stack, written)
    check_services(docs)
    images = {c["image"] for _, p, _ in pods(docs) for c in p["spec"]["containers"]}
    assert len(images) == 1, images  # one image for every role
    if "router" in roles:
        router = service_config(stack, "router").router
        for role in ("prefill", "relay"):
            assert getattr(router, role) == [service_address(docs, role)], role
        if "main" in roles:
            assert router.main == [service_address(docs, "main")]
        prefill = service_config(stack, "prefill")
        assert set(router.relay + (router.main_wan or router.main)) <= set(prefill.kv_peers)


def test_the_gateway_points_at_the_router_and_serves_what_its_probes_ask(rendered, monkeypatch):
    from serving.openai.app import create_app
    from serving.openai.upstream import GrpcUpstream

    paths = {r.path for r in create_app(None).routes}
    for name in kustomizations(deployable=True):
        docs = rendered[name]
        deps = of_kind(docs, "Deployment")
        if "pddjax-openai" not in deps:
            continue
        pod = deps["pddjax-openai"]["spec"]["template"]
        (c,) = pod["spec"]["containers"]
        args = serve_args(c)
        assert (args.command, args.role) == ("serve", "openai")
        assert args.router == service_address(docs, "router")
        assert args.model == stack_of(docs)["model"]
        assert ports_of(c)["http"] == args.port
        assert c["readinessProbe"]["httpGet"]["path"] in paths and "/metrics" not in paths
        annotations = pod["metadata"]["annotations"]  # its metrics: their own port, not the public one
        assert annotations["prometheus.io/port"] == env_of(c)[env.METRICS_PORT.name] == str(ports_of(c)["metrics"])
        https = bool(args.https_cert and args.https_key)  # the files: mounted from the Secret
        assert plaintext_problem(args.host, args.insecure, token=True, https=https) is None  # it would start
        assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
        for path in (args.https_cert, args.https_key):
            assert mounted(pod["spec"], c, path)[0]["secret"]["secretName"] == "pddjax-openai-https"
        vol, name_ = mounted(pod["spec"], c, os.path.join(env_of(c)[security.TLS_DIR_ENV], "ca.pem"))
        assert [i["path"] for i in vol["secret"]["items"]] == [name_] == ["ca.pem"]  # the CA only, no key
        for k, v in env_of(c).items():
            monkeypatch.setenv(k, v)
        GrpcUpstream(args.router)  # refuses to forward API keys to a non-loopback router in plaintext


def test_cluster_a_and_cluster_b_point_at_each_other(rendered):
    a, b = rendered["overlays/cluster-a"], rendered["overlays/cluster-b"]
    assert {r for r, _, _ in pods(a)} == {"prefill", "relay", "router", "openai"}
    assert {r for r, _, _ in pods(b)} == {"main"}
    md = of_kind(b, "Service")["pddjax-main"]
    assert md["spec"]["type"] == "LoadBalancer"
    (port,) = [p["port"] for p in md["spec"]["ports"]]  # gRPC only: /metrics stays inside cluster B
    external = f"{md['metadata']['annotations']['external-dns.alpha.kubernetes.io/hostname']}:{port}"
    router = service_config(stack_of(a), "router").router
    assert router.main == router.main_wan == [external]
    assert service_config(stack_of(b), "main").port == port
    assert external in service_config(stack_of(a), "prefill").kv_peers


def test_accelerator_component_reaches_every_engine_and_nothing_else(rendered):
    docs = rendered["examples/cluster-a-gpu"]
    for role, pod, _ in pods(docs):
        (c,) = pod["spec"]["containers"]
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert (gpus is not None) == (role in ENGINE_ROLES), role
        if role in ENGINE_ROLES:
            assert env_of(c)["JAX_PLATFORMS"] == "cuda"
            assert pod["spec"]["tolerations"] and pod["spec"]["nodeSelector"]


def test_leaderworkerset_variant(lws_rendered, written):
    docs = lws_rendered
    assert "pddjax-main" not in of_kind(docs, "Deployment")
    (lws,) = of_kind(docs, "LeaderWorkerSet").values()
    assert [c["image"] for _, p, _ in pods(docs) for c in p["spec"]["containers"]] == \
        [c["image"] for _, p, _ in pods(render(os.path.join(DEPLOY, "overlays", "cluster-b")))
         for c in p["spec"]["containers"]] * 2
    check_services(docs)
    assert of_kind(docs, "Service")["pddjax-main"]["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] \
        == "0"
    flags = {a for a in lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["args"]
             if a.startswith("--")}
    known = {s for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions
             for s in a.option_strings}
    missing = flags - known
    if missing:
        pytest.skip(f"the multi-host support has not landed: `pddjax serve` has no {', '.join(sorted(missing))}")
    stack = stack_of(docs)
    for role, pod, kind in pods(docs):
        check_grpc_pod(role, pod, kind, stack, written)
