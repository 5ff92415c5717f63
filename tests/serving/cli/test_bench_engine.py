"""`pddjax bench engine`'s constrained column on the tiny model (its tokenizer from
tests/grammar/tiny_vocab.py): a fresh 20-property schema is compiled and timed, each batch's
decode step runs with every row under it between two plain ones, and nothing compiles."""

from __future__ import annotations

import numpy as np

from pddjax.engines.engine_config import EngineConfig
from pddjax.engines.paged_engine import PagedEngine
from pddjax.engines.step import compile_count
from serving.cli import bench_engine
from tests.grammar.tiny_vocab import compiler


def test_the_constrained_column_times_a_schema_and_a_masked_decode(tiny):
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint,
                      EngineConfig(page_size=16, num_pages=256, max_step_tokens=512, max_rows=4), grammar=compiler())
    eng.precompile()
    rng = np.random.default_rng(0)

    def prompt(n):
        return rng.integers(3, 300, n).tolist()

    def prefill_all(ids):
        while eng.has_work() and any(not eng.seqs[i].generated for i in ids):
            eng.step()

    figures = {}
    before = compile_count()
    bench_engine._constrained(figures, eng, eng.grammar, [1, 4], prompt, prefill_all, 40, 3)
    assert compile_count() == before  # the mask is in every stated shape
    assert 0 < figures["grammar_compile_ms"] < 5000
    for b in ("1", "4"):
        assert figures["constrained_decode_ms"][b] > 0 and figures["plain_decode_ms"][b] > 0
        plain = figures["plain_decode_ms"][b]
        ratio = figures["constrained_decode_ms"][b] / plain
        # the ratio is taken before plain_decode_ms is rounded to 0.01 ms, then rounded to 0.001
        assert abs(figures["constrained_over_plain"][b] - ratio) <= ratio * 0.005 / plain + 5e-4 + 1e-9
    assert not eng.seqs  # every row released
    eng.check_integrity()
    schema = bench_engine._schema("x")
    assert len(schema["properties"]) == bench_engine.SCHEMA_PROPERTIES == len(schema["required"])


def test_the_bench_reports_the_better_of_two_decode_rounds_and_fractions_of_the_floor(tmp_path):
    """The whole command on the tiny model: decode is timed in two rounds (first and last), the
    figure is the better one, every step has a floor and a fraction, and nothing compiles in the
    second round."""
    import json

    from serving.cli import main

    out = tmp_path / "engine.json"
    assert main(["bench", "engine", "--model", "tiny", "--batches", "1,2", "--extends", "1,16", "--repeats", "2",
                 "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert set(figures["decode_ms_rounds"]) == {"1", "2"}
    for b, (first, last) in figures["decode_ms_rounds"].items():
        assert figures["decode_ms"][b] == min(first, last) > 0
    assert figures["compiles_after_warmup"] == 0
    steps = figures["roofline"]["decode"] | figures["roofline"]["extend"]
    assert all(s["fraction"] == round(s["measured_ms"] / s["floor_ms"], 2) for s in steps.values())
