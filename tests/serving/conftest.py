"""Fixtures of the serving tests that run real service processes, one set per test module (module
scope: a stack takes seconds to start and compiles in each process). Each module says what it runs
by module-level names, not by a fixture of its own:

  - `stack`: service processes started in this test process. `make_stack(workdir)` if the module
    defines it, else `Stack(STACK, workdir)` (tests/support/serving_stack.py) from its STACK; the
    module's ENV (if any) is in the environment while they start. A module whose STACK is
    TINY_STACK itself (and no make_stack, no ENV) runs on `tiny_stack`, the one such stack of the
    session, instead of starting its own.
  - `client`: a router client on `stack`'s router.
  - `up`: a `pddjax up` subprocess (UpProcess), what the module's `start_up(request, workdir)`
    returns; `request.param` is the module's indirect parametrization of `up`, if any, and other
    fixtures come from `request.getfixturevalue`.
Each is closed after the module's last test; `tiny_stack` at the end of the session.

On `tiny_stack` a module finds the link at full speed and every tier idle, and must leave them so
(checked after its last test); it must not stop or restart a service (a module that does starts
its own stack), and it draws prompts no other module on it draws (the caches keep every prompt
the stack has seen: another module's prefix would be a cache hit here). A test of router
settings runs a `Router` of its own on it (tests/support/serving_stack.py)."""

from __future__ import annotations

import pytest

from serving.client import Client
from tests.support.serving_stack import TINY_STACK, Stack
from tests.support.stack_checks import assert_idle


def _workdir(request, tmp_path_factory):
    return tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])


@pytest.fixture(scope="session")
def tiny_stack(tmp_path_factory):
    """The session's one stack of TINY_STACK, started for its first user."""
    s = Stack(TINY_STACK, str(tmp_path_factory.mktemp("tiny_stack")))
    try:
        yield s
    finally:
        s.close()


def _on_tiny_stack(module) -> bool:
    return getattr(module, "STACK", None) is TINY_STACK and not hasattr(module, "make_stack") \
        and not getattr(module, "ENV", None)


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory):
    module = request.module
    if _on_tiny_stack(module):
        s = request.getfixturevalue("tiny_stack")
        yield s
        s.link.set()  # what the next module finds: the link at full speed, every tier idle
        assert_idle(s, timeout=30.0)
        return
    make = getattr(module, "make_stack", None) or (lambda workdir: Stack(module.STACK, workdir))
    with pytest.MonkeyPatch.context() as mp:
        for k, v in getattr(module, "ENV", {}).items():
            mp.setenv(k, v)
        s = make(str(_workdir(request, tmp_path_factory)))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def client(stack):
    c = Client(stack.addr["router"])
    yield c
    c.close()


@pytest.fixture(scope="module")
def up(request, tmp_path_factory):
    u = request.module.start_up(request, _workdir(request, tmp_path_factory))
    try:
        yield u
    finally:
        u.close()
