"""`pddjax bench speculative` (serving/bench/speculative/): a cell runs the same requests with
drafts on and opted out on one engine and compares them; bad arguments are one-line errors."""

import argparse

import pytest

from pddjax.engines.paged_engine import EngineConfig, PagedEngine
from pddjax.errors import UserError
from pddjax.model.sampling_params import SamplingParams
from serving.bench.speculative import command
from serving.bench.speculative.workloads import Request
from tests.support.samples import prompt, repetitive


def test_a_cell_compares_the_same_tokens_with_drafts_on_and_off(tiny):
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint,
                      EngineConfig(page_size=8, num_pages=200, max_step_tokens=64, max_rows=20,
                                   speculative="ngram", spec_max_tokens=4))
    eng.step_costs = None  # every draft verified: the tiny model's step costs are noise
    reqs = [Request(repetitive(30 + i, i), 24, SamplingParams(), ()) for i in range(3)] + \
        [Request(prompt(12, 7), 24, SamplingParams(temperature=0.8, seed=5), ())]
    for streams, rounds in ((1, 1), (4, 2)):
        cell = command._cell(eng, reqs, streams, streams == 4, f"t{streams}", rounds)
        assert cell["exact"] and not cell["diverged_at"], cell
        # 24 tokens each, the first sampled by the prefill (untimed); at 4 streams a row that
        # finished its prompt early also decodes while the others still prefill (untimed too)
        per_round = 4 * 23
        assert cell["decode_tokens"] == per_round if streams == 1 else 0 < cell["decode_tokens"] <= rounds * per_round
        assert cell["rounds"] == rounds and len(cell["speedups"]) == rounds and all(x > 0 for x in cell["speedups"])
        assert cell["drafted"] >= cell["accepted"] > 0 and 0 < cell["acceptance"] <= 1
        assert cell["steps_on"] < cell["steps_off"]  # accepted drafts saved steps
        assert cell["speedup"] > 0
    assert not eng.seqs and eng.num_pages_active == 0
    eng.check_integrity()


def test_first_difference():
    assert command._first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert command._first_difference([1, 2], [1, 2, 3]) == 2


@pytest.mark.parametrize("flags,words", [({"workloads": "copy,poems"}, "unknown workload"),
                                         ({"streams": "1,9"}, "--streams"),
                                         ({"streams": "x"}, "--streams"),
                                         ({"spec_max_tokens": 0}, "--spec-max-tokens"),
                                         ({"rounds": 0}, "--rounds")])
def test_bad_arguments_are_one_line_errors(flags, words):
    args = argparse.Namespace(model="tiny", workloads="copy", streams="1,4", max_tokens=16, spec_max_tokens=4,
                              rounds=2, json=None)
    for k, v in flags.items():
        setattr(args, k, v)
    with pytest.raises(UserError, match=words):
        command.run(args)


def test_a_model_without_a_tokenizer_is_refused():
    args = argparse.Namespace(model="tiny", workloads="copy", streams="1", max_tokens=16, spec_max_tokens=4,
                              rounds=1, json=None)
    with pytest.raises(UserError, match="no tokenizer"):
        command.run(args)
