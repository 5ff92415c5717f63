"""Shared fixtures. JAX's persistent compilation cache is on, so reruns reuse compiled code."""

from __future__ import annotations

import pytest

from pddjax.model.jax_setup import configure

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
