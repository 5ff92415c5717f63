"""Fixtures of the serving tests that run real service processes, one set per test module (module
scope: a stack takes seconds to start and compiles in each process). Each module says what it runs
by module-level names, not by a fixture of its own:

  - `stack`: service processes started in this test process. `make_stack(workdir)` if the module
    defines it, else `Stack(STACK, workdir)` (tests/support/serving_stack.py) from its STACK; the
    module's ENV (if any) is in the environment while they start.
  - `client`: a router client on `stack`'s router.
  - `up`: a `pddjax up` subprocess (UpProcess), what the module's `start_up(request, workdir)`
    returns; `request.param` is the module's indirect parametrization of `up`, if any, and other
    fixtures come from `request.getfixturevalue`.
Each is closed after the module's last test."""

from __future__ import annotations

import pytest

from serving.client import Client
from tests.support.serving_stack import Stack


def _workdir(request, tmp_path_factory):
    return tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory):
    module = request.module
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
