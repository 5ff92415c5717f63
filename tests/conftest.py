"""Shared fixtures. JAX's persistent compilation cache is on, so reruns reuse compiled code.

Every engine and service the suite starts (in this process or as a child, which inherits the
environment) serves on its covering set of step shapes and builds no more
(PDDJAX_BACKGROUND_BUILD=0): the rest of a set costs a stack start its tracing, lowering and, on an
empty cache, compiles, and no test needs it; tests/engines/test_background_build.py turns it back on.
Test models compile quickly (PDDJAX_QUICK_COMPILE_MAX_PARAMS, below)."""

from __future__ import annotations

import os

import pytest

from pddjax import env
from pddjax.model.jax_setup import configure

# Test models (the tiny and HF fixture models, 0.09-0.15M parameters) compile at XLA's backend
# optimization level 0: half the compile, and their steps stay about a millisecond; the real
# model (135M) keeps XLA's defaults (its step would run 2.5x slower)
QUICK_COMPILE_MAX_PARAMS = 20_000_000

os.environ.setdefault(env.BACKGROUND_BUILD.name, "0")
os.environ.setdefault(env.QUICK_COMPILE_MAX_PARAMS.name, str(QUICK_COMPILE_MAX_PARAMS))
configure()


@pytest.fixture(scope="session")
def tiny():
    from pddjax.model.registry import load_model

    return load_model("tiny")


@pytest.fixture(scope="session")
def smollm():
    """The real model (weights-cached after the first load in this environment)."""
    from pddjax.model.registry import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def ref(tiny):
    """The monolithic reference engine over the tiny model: what every engine and stack must equal."""
    from pddjax.engines.reference import ReferenceEngine

    return ReferenceEngine(tiny.config, tiny.weights)
