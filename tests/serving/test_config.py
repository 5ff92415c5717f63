"""A role's engine table is exactly EngineConfig's fields, checked by EngineConfig itself; the
router's auto-policy defaults are the policy's own."""

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
             "max_rows": 4, "prefix_cache": False, "pad_limit": 2.0, "tensor_parallel": 2}
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
    ({"pad_limit": -1}, "pad_limit must be a number >= 0"),
])
def test_bad_engine_values_are_one_sentence_naming_the_role(table, words):
    with pytest.raises(UserError, match=f"\\[prefill\\] {words}"):
        service_config({"prefill": table}, "prefill")


def test_router_policy_defaults_come_from_the_policy():
    s, p = RouterSettings(), PolicyConfig()
    assert (s.ttft_budget_ms, s.filter_cap, s.filter_window, s.drift_tolerance, s.handoff_threshold) == (
        p.ttft_budget_s * 1e3, p.filter_cap, p.filter_window, p.drift_tolerance, p.handoff_threshold)
