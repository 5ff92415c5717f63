"""The rendered manifests every deploy/ test module reads (tests/support/kustomize.py)."""

from __future__ import annotations

import os

import pytest

from tests.support.kustomize import DEPLOY, kustomizations, render, render_lws


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {k: render(os.path.join(DEPLOY, k)) for k in kustomizations()}


@pytest.fixture(scope="module")
def lws_rendered(tmp_path_factory) -> list[dict]:
    """overlays/cluster-b with its commented components/lws-main line switched on."""
    return render_lws(str(tmp_path_factory.mktemp("deploy")))
