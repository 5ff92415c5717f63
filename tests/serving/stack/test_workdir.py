"""A stopped stack's run folder (`serving/stack/up.end_workdir`): gone after a stop the user
asked for; after a failure its services' log stays for a look, and no copy of a secret does."""

from __future__ import annotations

import os

import pytest

from serving.stack.up import SECRET_COPIES, end_workdir


def run_folder(tmp_path):
    d = tmp_path / "pddjax-up-x"
    (d / "tls").mkdir(parents=True)
    for name in ("ca.pem", "relay-key.pem"):
        (d / "tls" / name).write_text("secret")
    (d / "router-token").write_text("token")
    (d / "services.log").write_text("relay0: Traceback ...")
    (d / "stack.json").write_text("{}")
    return d


@pytest.mark.parametrize("rc", [0, 130])
def test_a_stop_asked_for_removes_the_folder(tmp_path, rc):
    d = run_folder(tmp_path)
    end_workdir(str(d), rc)
    assert not d.exists()


@pytest.mark.parametrize("rc", [1, None])  # a role with no service left; an exception
def test_a_failure_keeps_the_log_and_drops_the_secrets(tmp_path, capsys, rc):
    d = run_folder(tmp_path)
    end_workdir(str(d), rc)
    assert sorted(os.listdir(d)) == ["services.log", "stack.json"]
    assert set(SECRET_COPIES) == {"tls", "router-token"}
    assert f"kept in {d / 'services.log'}" in capsys.readouterr().err
