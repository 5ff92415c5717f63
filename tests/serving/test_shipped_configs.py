"""Every shipped stack config (configs/*.toml, deploy/**/stack.toml and the packaged default)
states only what differs from the code's defaults, so a default changed in code reaches every
deployment: a key that restates the value it would get anyway fails here. The defaults are the
code's own: ServiceConfig, RouterSettings (the auto policy's from PolicyConfig), EngineConfig and
WanLink's parameters, and a role table inherits the top level and `[engine]`. The default stack
is package data found through importlib.resources (an installed wheel carries it)."""

from __future__ import annotations

import dataclasses
import glob
import inspect
import os
import tomllib
from importlib import resources

import pytest

from pddjax.engines.engine_config import EngineConfig
from pddjax.policy import PolicyConfig
from serving.config import (
    DEFAULT_STACK,
    ENGINE_ROLES,
    ROLES,
    RouterSettings,
    ServiceConfig,
    default_stack,
    service_config,
)
from serving.stack.wanlink import WanLink
from tests.support.paths import CONFIGS, ROOT

# top-level keys; every role table may override them
TOP = ("model", "platform", "host", "insecure", "reflection", "max_concurrent_rpcs")
SHIPPED = sorted(glob.glob(os.path.join(CONFIGS, "*.toml"))
                 + glob.glob(os.path.join(ROOT, "deploy", "**", "stack.toml"), recursive=True))


def field_defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def inherited(stack: dict, table: str | None) -> dict:
    """What each key of `table` (None: the top level) is when the file leaves it out."""
    service = {k: v for k, v in field_defaults(ServiceConfig).items() if k not in ("engine", "router")}
    top = {k: service[k] for k in TOP}
    if table is None:
        return top
    own = {**service, **{k: stack[k] for k in TOP if k in stack}}
    if table == "engine":
        return field_defaults(EngineConfig)
    if table in ENGINE_ROLES:
        return {**own, **field_defaults(EngineConfig), **stack.get("engine", {})}
    if table == "router":
        wan_kv = stack.get("wan", {}).get("kv_wire", RouterSettings.kv_wire)
        return {**own, **field_defaults(RouterSettings), "kv_wire": wan_kv}
    if table == "wan":
        params = inspect.signature(WanLink.__init__).parameters.values()
        link = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        return {**link, "kv_wire": RouterSettings.kv_wire}
    raise AssertionError(f"unknown table [{table}]")


def restated(stack: dict) -> list[str]:
    """`[table] key = value` for every key whose value is what it would be without it."""
    found = []
    tables = [(None, {k: v for k, v in stack.items() if not isinstance(v, dict)})]
    tables += [(t, v) for t, v in stack.items() if isinstance(v, dict)]
    for table, keys in tables:
        defaults = inherited(stack, table)
        for key, value in keys.items():
            assert key in defaults, f"[{table or 'top level'}] {key}: no default known to this test"
            if value == defaults[key]:
                found.append(f"[{table or 'top level'}] {key} = {value!r}")
    return found


def read(path: str) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def test_every_shipped_config_is_found():
    names = {os.path.relpath(p, ROOT) for p in SHIPPED}
    assert {"configs/tiny.toml", "deploy/base/stack.toml", "deploy/overlays/cluster-a/stack.toml",
            "deploy/overlays/cluster-b/stack.toml"} <= names, names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: os.path.relpath(p, ROOT))
def test_a_shipped_config_restates_no_default(path):
    stack = read(path)
    found = restated(stack)
    assert not found, f"{os.path.relpath(path, ROOT)} restates the code's defaults (drop them): {'; '.join(found)}"
    for role in ROLES:
        service_config(stack, role)  # and it still loads


def test_the_default_stack_restates_no_default():
    assert restated(default_stack()) == []
    for role in ROLES:
        service_config(default_stack(), role)


def test_a_restated_default_is_caught():
    """The check itself: the code's handoff threshold, an [engine] value in a role table, the top-level host."""
    threshold = PolicyConfig().handoff_threshold
    assert restated({"router": {"handoff_threshold": threshold}}) == [f"[router] handoff_threshold = {threshold}"]
    assert restated({"router": {"handoff_threshold": threshold + 60}}) == []
    assert restated({"engine": {"num_pages": 512}, "relay": {"num_pages": 512}}) == ["[relay] num_pages = 512"]
    assert restated({"host": "127.0.0.1", "wan": {"mbps": 0}}) == ["[top level] host = '127.0.0.1'", "[wan] mbps = 0"]
    assert restated({"host": "0.0.0.0", "router": {"host": "0.0.0.0"}}) == ["[router] host = '0.0.0.0'"]


def test_the_default_stack_is_package_data_found_through_importlib_resources():
    packaged = resources.files("serving").joinpath(DEFAULT_STACK)
    assert packaged.is_file()
    assert default_stack() == tomllib.loads(packaged.read_text(encoding="utf-8"))
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert DEFAULT_STACK in package_data["serving"]  # a wheel (non-editable install) carries it
    assert all(read(p) != default_stack() for p in SHIPPED)  # one copy: configs/ holds the other examples


def test_pddjax_up_without_a_config_runs_the_default_stack():
    from serving.cli import build_parser
    from serving.cli.serve import load_stack

    stack = load_stack(build_parser().parse_args(["up"]))
    assert stack["model"] == default_stack()["model"]
    assert stack["engine"] == default_stack()["engine"]
