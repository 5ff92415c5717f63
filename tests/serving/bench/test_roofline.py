"""The roofline of `bench engine` (serving/bench/roofline.py): a step's floor is its bytes over the
read bandwidth or its FLOPs over the matmul peak, whichever is larger, counted by hand here for
the real model's shape."""

from pddjax.model.config import NAMED_CONFIGS
from serving.bench import roofline

LIMITS = {"read_gb_s": 40.0, "matmul_gflop_s": 400.0}


def test_decode_of_one_row_is_bound_by_reading_the_weights():
    cfg = NAMED_CONFIGS["smollm2-135m"]
    f = roofline.step_floor(cfg, 4, LIMITS, tokens=1, rows=1, context=256, pairs=256)
    E, F, L, V = cfg.hidden, cfg.ffn_hidden, cfg.num_layers, cfg.vocab_size
    qkvo = E * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_heads * cfg.head_dim * E
    weights = L * (qkvo + 3 * E * F) + E * V  # ~135M: the weights a step reads
    kv = 256 * L * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    assert 130e6 < weights < 140e6
    assert f["bytes_mb"] == round((4 * weights + kv) / 1e6, 1)
    assert f["floor_ms"] == f["read_ms"] == round(1e3 * (4 * weights + kv) / 40e9, 2)
    assert f["compute_ms"] < f["read_ms"] / 10


def test_a_long_prefill_is_bound_by_compute_and_rows_add_kv():
    cfg = NAMED_CONFIGS["smollm2-135m"]
    f = roofline.step_floor(cfg, 4, LIMITS, tokens=512, rows=1, context=512, pairs=512 * 513 // 2)
    assert f["floor_ms"] == f["compute_ms"] > f["read_ms"]
    one, many = (roofline.step_floor(cfg, 4, LIMITS, tokens=b, rows=b, context=256, pairs=256 * b) for b in (1, 32))
    assert many["bytes_mb"] > one["bytes_mb"] and many["gflop"] > 30 * one["gflop"] * 0.9


def test_fractions_and_the_table():
    cfg = NAMED_CONFIGS["smollm2-135m"]
    figures = {"decode_ms": {"1": 30.0, "32": 150.0}, "extend_ms": {"64": 100.0},
               "prefill_tokens": 512, "prefill_tokens_per_s": 800.0}
    roof = roofline.roofline(figures, cfg, 4, LIMITS, 256)
    d1 = roof["decode"]["1"]
    assert d1["fraction"] == round(30.0 / d1["floor_ms"], 2) and d1["fraction"] > 1
    assert roof["prefill"]["measured_ms"] == 640.0
    assert 0 < roof["prefill"]["of_matmul_peak"] < 1
    text = roofline.table(roof)
    assert "| decode 32 | 150.0 |" in text and "| extend 64 | 100.0 |" in text and "% of matmul peak" in text
