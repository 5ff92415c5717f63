"""The cost rule of speculation (engines/speculate.worth_it): a draft is verified only when the
tokens it is expected to add pay for the rows it adds, by step costs measured per row bucket;
a row whose drafts keep losing probes now and then; outputs stay plain decoding's whatever the
rule keeps."""

from pddjax.engines import speculate
from pddjax.engines.drafter import Drafter
from pddjax.engines.paged_engine import EngineConfig, PagedEngine
from pddjax.model.sampling_params import SamplingParams
from tests.support.samples import repetitive


class Row:
    def __init__(self, acceptance: float):
        self.drafter = Drafter([1, 2, 3], 4)
        self.drafter.acceptance = acceptance


def costs(**by_rows) -> speculate.StepCosts:
    c = speculate.StepCosts()
    for rows, seconds in by_rows.items():
        c.observe(int(rows[1:]), seconds)
    return c


CPU_LIKE = costs(b1=1.0, b2=2.0, b4=2.2, b8=2.5)  # matrix-vector at 1 row, matrix-matrix above


def test_a_lone_row_drafts_only_while_it_copies_well():
    good, poor = [(Row(0.95), 1)], [(Row(0.3), 1)]
    assert speculate.worth_it({0: [4, 5, 6, 7]}, good, CPU_LIKE) == {0: [4, 5, 6, 7]}  # 1 + 3.5 tokens for 2.5x
    assert speculate.worth_it({0: [4, 5, 6, 7]}, poor, CPU_LIKE) == {}  # 1.4 tokens for 2.5x: no
    assert poor[0][0].drafter.trimmed == 1


def test_the_best_number_of_drafts_is_kept_not_the_first_that_pays():
    # one draft alone crosses 1 -> 2 rows at 2x for at most 1 token: never better; four do better
    rows = [(Row(0.9), 1)]
    assert speculate.worth_it({0: [4, 5, 6, 7]}, rows, CPU_LIKE) == {0: [4, 5, 6, 7]}
    flat_after_two = costs(b1=1.0, b2=1.1, b4=3.0, b8=3.0)
    assert speculate.worth_it({0: [4, 5, 6, 7]}, [(Row(0.9), 1)], flat_after_two) == {0: [4]}


def test_free_rows_are_always_taken_and_unmeasured_sizes_are_tried():
    flat = costs(b1=1.0, b2=1.0, b4=1.0, b8=1.0)
    assert speculate.worth_it({0: [4, 5]}, [(Row(0.2), 1)], flat) == {0: [4, 5]}
    only_one = costs(b1=1.0)
    assert speculate.worth_it({0: [4, 5]}, [(Row(0.2), 1)], only_one) == {0: [4, 5]}
    assert speculate.worth_it({0: [4, 5]}, [(Row(0.2), 1)], None) == {0: [4, 5]}


def test_rows_of_higher_acceptance_choose_first():
    rows = [(Row(0.2), 1), (Row(0.95), 1), (Row(0.2), 1), (Row(0.2), 1)]  # 4 rows; 4 more fill bucket 8
    c = costs(b4=1.0, b8=1.6, b16=3.2)
    got = speculate.worth_it({0: [9, 9, 9, 9], 1: [4, 5, 6, 7], 2: [9], 3: [9]}, rows, c)
    assert got == {1: [4, 5, 6, 7]}


def test_a_row_trimmed_again_and_again_probes_with_one_draft():
    row = [(Row(0.1), 1)]
    kept = [speculate.worth_it({0: [4, 5]}, row, CPU_LIKE) for _ in range(speculate.TRIMMED_PROBE_EVERY)]
    assert kept[:-1] == [{}] * (speculate.TRIMMED_PROBE_EVERY - 1) and kept[-1] == {0: [4]}
    assert row[0][0].drafter.trimmed == 0


def test_step_costs_take_the_lower_quartile_so_a_compile_or_a_busy_host_does_not_count():
    c = speculate.StepCosts()
    for s in (30.0, 0.010, 0.011, 0.012):  # the first use compiled
        c.observe(2, s)
    assert c.get(2) == 0.011 and c.get(3) is None  # 3 rows run as the 4-row bucket
    for s in (0.050, 0.080, 0.081, 0.079, 0.052, 0.080, 0.051, 0.082, 0.078):  # steps slowed by other work
        c.observe(4, s)
    assert c.get(4) == 0.052  # the median would read 0.079


def test_an_engine_whose_drafts_do_not_pay_verifies_almost_none_and_decodes_the_same(tiny, ref):
    cfg = EngineConfig(page_size=8, num_pages=256, max_step_tokens=64, max_rows=16, speculative="ngram",
                       spec_max_tokens=4)
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, cfg)
    eng.step_costs = costs(b1=1.0, b2=100.0, b4=100.0, b8=100.0)  # a draft never pays
    p = repetitive(40, 1)
    eng.add("r", p, SamplingParams(), 60, ())
    out = []
    while eng.has_work():
        out += [e.token for e in eng.step()]
        eng.step_costs.samples[1].clear()
        eng.step_costs.observe(1, 1.0)  # the engine's own timings would replace the injected ones
    assert out == ref.generate(p, SamplingParams(), 60, ()).token_ids
    assert eng.spec_drafted <= 60 // speculate.TRIMMED_PROBE_EVERY + 1  # probes only
    eng.check_integrity()
