"""deploy/ as Kubernetes would see it: every Kustomization under it, each rendered with
`kubectl kustomize` (KUBECTL None where it is missing), and the pod templates of what renders
(a LeaderWorkerSet's leader and worker with the label its controller gives each pod)."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess

import yaml

from tests.support.paths import ROOT

DEPLOY = os.path.join(ROOT, "deploy")
KUBECTL = shutil.which("kubectl")


def kustomizations(deployable: bool = False) -> list[str]:
    """Every directory under deploy/ that is a Kustomization (components render only inside one);
    `deployable`: those that generate the stack ConfigMap (the rest are base/'s parts)."""
    out = []
    for d, _, files in os.walk(DEPLOY):
        if "kustomization.yaml" in files:
            with open(os.path.join(d, "kustomization.yaml")) as f:
                k = yaml.safe_load(f)
            if k["kind"] == "Kustomization" and (not deployable or "stack.toml" in os.listdir(d)
                                                 or "../../overlays/" in str(k.get("resources"))):
                out.append(os.path.relpath(d, DEPLOY))
    return sorted(out)


def render(path: str) -> list[dict]:
    run = subprocess.run([KUBECTL, "kustomize", path], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"kubectl kustomize {path}: {run.stderr}"
    return [d for d in yaml.safe_load_all(run.stdout) if d]


def render_lws(workdir: str) -> list[dict]:
    """overlays/cluster-b with its commented components/lws-main line switched on (a copy of deploy/ in workdir)."""
    copied = os.path.join(workdir, "deploy")
    shutil.copytree(DEPLOY, copied)
    path = os.path.join(copied, "overlays", "cluster-b", "kustomization.yaml")
    with open(path) as f:
        text = f.read()
    on = text.replace("# components:\n#   - ../../components/lws-main", "components:\n  - ../../components/lws-main")
    assert on != text, "overlays/cluster-b no longer carries the commented lws-main component"
    with open(path, "w") as f:
        f.write(on)
    return render(os.path.join(copied, "overlays", "cluster-b"))


def of_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pods(docs):
    """(role, pod spec, pod labels) of every Deployment and every LeaderWorkerSet template."""
    for d in docs:
        if d["kind"] == "Deployment":
            yield d["metadata"]["labels"]["app.kubernetes.io/component"], d["spec"]["template"], "deployment"
        if d["kind"] == "LeaderWorkerSet":  # with the label the LWS controller puts on each pod
            t, role = d["spec"]["leaderWorkerTemplate"], d["metadata"]["labels"]["app.kubernetes.io/component"]
            for kind, index in (("leader", "0"), ("worker", "1")):
                pod = copy.deepcopy(t[f"{kind}Template"])
                pod["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] = index
                yield role, pod, kind
