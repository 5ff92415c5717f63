"""The tiny model: cached, incremental decoding gives the same logits as one full forward."""

import jax.numpy as jnp
import numpy as np

from pddjax.engines.reference import ReferenceEngine
from pddjax.model.dense import DenseKV, forward_dense, forward_full
from pddjax.model.sampling_params import SamplingParams
from pddjax.model.weights import cast


def test_prefill_plus_steps_equals_full_forward(tiny):
    cfg, w = tiny.config, cast(tiny.weights, jnp.float32)
    rng = np.random.default_rng(0)
    seq = rng.integers(3, cfg.vocab_size, size=(1, 24)).astype(np.int32)
    full = np.asarray(forward_full(w, cfg, jnp.asarray(seq)))  # [1, 24, V]

    n_prompt = 10
    cache = DenseKV.zeros(cfg, 1, 32, jnp.float32)
    pos = jnp.arange(n_prompt, dtype=jnp.int32)[None]
    logits, cache = forward_dense(w, cfg, jnp.asarray(seq[:, :n_prompt]), pos, cache)
    steps = [np.asarray(logits[0])]
    for p in range(n_prompt, 24):
        logits, cache = forward_dense(w, cfg, jnp.asarray(seq[:, p:p + 1]), jnp.full((1, 1), p, jnp.int32), cache)
        steps.append(np.asarray(logits[0]))
    inc = np.concatenate(steps, axis=0)
    # float32, 2 layers: differences come only from summation order
    np.testing.assert_allclose(inc, full[0], rtol=1e-4, atol=1e-4)


def test_batch_rows_are_independent(tiny):
    cfg, w = tiny.config, cast(tiny.weights, jnp.float32)
    seq = np.random.default_rng(1).integers(3, cfg.vocab_size, size=(3, 12)).astype(np.int32)
    both = np.asarray(forward_full(w, cfg, jnp.asarray(seq)))
    for b in range(3):
        one = np.asarray(forward_full(w, cfg, jnp.asarray(seq[b:b + 1])))
        np.testing.assert_allclose(both[b], one[0], rtol=1e-5, atol=1e-5)


def test_reference_engine_greedy_follows_full_forward_argmax(tiny):
    cfg = tiny.config
    eng = ReferenceEngine(cfg, tiny.weights)
    prompt = [5, 17, 99, 3, 250]
    out = eng.generate(prompt, SamplingParams(), max_tokens=12, stop_ids=()).token_ids
    assert len(out) == 12
    full = np.asarray(forward_full(eng.weights, cfg, jnp.asarray([prompt + out], jnp.int32)))[0]
    expected = full[len(prompt) - 1:-1].argmax(-1)
    assert out == expected.tolist()


def test_bfloat16_runs_and_stays_close(tiny):
    cfg = tiny.config
    prompt = [5, 17, 99, 3, 250, 7]
    f32 = ReferenceEngine(cfg, tiny.weights, jnp.float32)
    bf16 = ReferenceEngine(cfg, tiny.weights, jnp.bfloat16)
    a = [lg for _, lg in f32.stream(prompt, SamplingParams(), 4, (), return_logits=True)]
    b = [lg for _, lg in bf16.stream(prompt, SamplingParams(), 1, (), return_logits=True)]
    # bfloat16 has ~3 significant digits; first-step logits agree to a few percent of their scale
    assert np.abs(a[0] - b[0]).max() < 0.05 * np.abs(a[0]).max() + 0.1


def test_stops_at_eos_and_reports_reason(tiny):
    eng = ReferenceEngine(tiny.config, tiny.weights)
    prompt = [5, 17, 99]
    free = eng.generate(prompt, SamplingParams(), max_tokens=6, stop_ids=()).token_ids
    stop_tok = free[2]
    res = eng.generate(prompt, SamplingParams(), max_tokens=6, stop_ids=(stop_tok,))
    assert res.token_ids == free[: free.index(stop_tok) + 1]
    assert res.finish_reason == "stop"
    assert eng.generate(prompt, SamplingParams(), max_tokens=6, stop_ids=()).finish_reason == "length"
