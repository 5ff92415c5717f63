"""A role's engine table is exactly EngineConfig's fields, checked by EngineConfig itself; the
router's auto-policy defaults are the policy's own; a port's RPC bound comes from the top level
or the role's table, and only RLD reads `handoff_peers`."""

from __future__ import annotations

import dataclasses

import pytest

from pddjax.engines.engine_config import EngineConfig
from pddjax.errors import UserError
from pddjax.policy import PolicyConfig
from serving.config import ENGINE_KEYS, RouterSettings, service_config


def test_engine_keys_are_engine_config_fields():
    assert ENGINE_KEYS == {f.name for f in dataclasses.fields(EngineConfig)}
    every = {"dtype": "bfloat16", "page_size": 32, "num_pages": 64, "attention": "auto", "max_step_tokens": 128,
             "max_rows": 4, "prefix_cache": False, "pad_limit": 2.0, "tensor_parallel": 2, "ready": "all",
             "speculative": "ngram", "spec_max_tokens": 3}
    assert set(every) == ENGINE_KEYS  # this test names every field: a new one must be added here
    cfg = service_config({"engine": every}, "relay")
    assert EngineConfig(**cfg.engine) == EngineConfig(**every)


@pytest.mark.parametrize("table, words", [
    ({"attention": "flash"}, "attention must be one of auto, xla, pallas"),
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"page_size": 0}, "page_size must be a positive integer"),
    ({"num_pages": 1}, "num_pages must be at least 2"),
    ({"max_rows": "8"}, "max_rows must be a positive integer"),
    ({"prefix_cache": "yes"}, "prefix_cache must be true or false"),
    ({"ready": "some"}, 'ready must be "all" or "cover"'),
    ({"pad_limit": -1}, "pad_limit must be a number >= 0"),
])
def test_bad_engine_values_are_one_sentence_naming_the_role(table, words):
    with pytest.raises(UserError, match=f"\\[prefill\\] {words}"):
        service_config({"prefill": table}, "prefill")


def test_router_policy_defaults_come_from_the_policy():
    s, p = RouterSettings(), PolicyConfig()
    assert (s.ttft_budget_ms, s.filter_cap, s.filter_window, s.drift_tolerance, s.handoff_threshold) == (
        p.ttft_budget_s * 1e3, p.filter_cap, p.filter_window, p.drift_tolerance, p.handoff_threshold)


def test_max_concurrent_rpcs_from_the_top_level_or_the_role_table():
    assert service_config({}, "main").max_concurrent_rpcs == 4096
    stack = {"max_concurrent_rpcs": 512, "router": {"max_concurrent_rpcs": 8192}}
    assert [service_config(stack, r).max_concurrent_rpcs for r in ("relay", "router")] == [512, 8192]
    for bad in (0, -1, "64", True, 1.5):
        with pytest.raises(UserError, match=r"\[main\] max_concurrent_rpcs must be an integer >= 1"):
            service_config({"main": {"max_concurrent_rpcs": bad}}, "main")


def test_handoff_peers_are_the_relays_own():
    assert service_config({"relay": {"handoff_peers": "md-a:50063,md-b:50063"}}, "relay").handoff_peers == [
        "md-a:50063", "md-b:50063"]
    assert service_config({"relay": {"handoff_peers": ["md-a:50063"]}}, "relay").handoff_peers == ["md-a:50063"]
    assert service_config({}, "relay").handoff_peers == []
    with pytest.raises(UserError, match="unknown engine key 'handoff_peers' for main"):
        service_config({"main": {"handoff_peers": ["md-a:50063"]}}, "main")
