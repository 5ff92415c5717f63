"""A stack's `max_context` (`pddjax up --max-context`): every role serves at most that many
tokens a request, below the model's own context. The value is checked (one sentence); an
engine built with it states page tables no wider than the cap and refuses a longer request with
one sentence; the router reports the cap as the model's context; a cap above the model's
changes nothing."""

from __future__ import annotations

import argparse

import pytest

from pddjax.errors import UserError
from pddjax.model.config import TINY
from serving import rpc
from serving.config import capped_context, service_config
from serving.pb import cluster_pb2

STACK = {"model": "tiny", "max_context": 256, "engine": {"num_pages": 64, "max_rows": 2, "max_step_tokens": 32}}


def test_the_cap_is_one_value_for_every_role_and_checked():
    assert {service_config(STACK, role).max_context for role in ("prefill", "relay", "main", "router")} == {256}
    assert service_config({"model": "tiny"}, "relay").max_context is None
    for bad in (8, 0, -1, "2048", 2048.0, True):
        with pytest.raises(UserError, match="max_context must be an integer of at least 16 tokens"):
            service_config({**STACK, "max_context": bad}, "relay")


def test_up_flag_sets_it():
    from serving.cli.serve import load_stack

    args = argparse.Namespace(config=None, model="tiny", dtype=None, wan_mbps=None, wan_latency_ms=None,
                              wan_capacity_mbps=None, kv_wire=None, max_context=512)
    assert load_stack(args)["max_context"] == 512
    with pytest.raises(UserError, match="max_context"):
        load_stack(argparse.Namespace(**{**vars(args), "max_context": 4}))


def test_capped_context_never_raises_the_models():
    assert capped_context(TINY, 256).max_context == 256
    assert capped_context(TINY, 10 ** 6) is TINY and capped_context(TINY, None) is TINY


def test_an_engine_serves_at_most_the_cap(tiny):
    from serving.stack.server import build_engine

    model, _, engine, channel = build_engine(service_config(STACK, "relay"))
    assert channel is None and model.config.max_context == 256 and engine.cfg.max_context == 256
    assert max(mp for _, _, mp, _ in engine.stated) == 256 // 16  # page tables stop at the cap
    fits = cluster_pb2.SequenceSpec(request_id="a", prompt=list(range(3, 203)), max_tokens=56)
    longer = cluster_pb2.SequenceSpec(request_id="b", prompt=list(range(3, 203)), max_tokens=57)
    for spec, refused in ((fits, False), (longer, True)):
        rid, prompt, params, max_tokens, _ = rpc.spec_from_pb(spec)
        err = rpc.validate_spec(model.config, rid, prompt, params, max_tokens)
        assert bool(err) == refused, err
    assert "256" in rpc.validate_spec(model.config, *rpc.spec_from_pb(longer)[:4])
    with pytest.raises(ValueError):
        engine.add("b", list(range(3, 203)), max_tokens=57)
    engine.add("a", list(range(3, 203)), max_tokens=56)
    engine.check_integrity()


def test_the_router_serves_the_capped_context():
    from serving.stack.server import build_servicer

    router = build_servicer(service_config(STACK, "router"))
    assert router.cfg.max_context == 256
