"""The fake engine follows its hand-checkable rule through a full P -> RLD -> MD handoff."""

import pytest

from pddjax.engines.engine_api import Engine
from pddjax.engines.fake_engine import FakeEngine
from pddjax.engines.paged_engine import PagedEngine
from pddjax.kv.canonical import KVImportError
from pddjax.model.sampling_params import SamplingParams


def test_rule_and_handoff():
    p, rld, md = FakeEngine(), FakeEngine(), FakeEngine()
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    p.add("r", prompt, SamplingParams(), 1, hold_on_finish=True)
    first = p.step()[0].token
    assert first == 19
    kv = p.export_kv("r", 0, len(prompt))
    p.release("r")
    rld.add("r", prompt, SamplingParams(), 10)
    rld.import_kv("r", kv)
    rld.append_tokens("r", 0, [first])
    relay = [first] + [rld.step()[0].token for _ in range(3)]
    assert relay == [19, 20, 21, 22]
    md.add("r", prompt, SamplingParams(), 10)
    md.import_kv("r", kv)
    md.append_tokens("r", 0, relay)
    ev = md.step()[0]
    assert (ev.position, ev.token) == (4, 23)
    md.check_integrity()


def test_corrupt_kv_refused():
    a, b = FakeEngine(), FakeEngine()
    a.add("r", [1, 2, 3], SamplingParams(), 1, hold_on_finish=True)
    a.step()
    kv = a.export_kv("r")
    kv.k[0, 1, 0, 0] = 99
    b.add("r", [1, 2, 3], SamplingParams(), 4)
    with pytest.raises(KVImportError):
        b.import_kv("r", kv)


def test_both_engines_satisfy_the_interface():
    assert issubclass(PagedEngine, Engine)
    assert all(callable(getattr(FakeEngine, m)) for m in Engine.__abstractmethods__)
