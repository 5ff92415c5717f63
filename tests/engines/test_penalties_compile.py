"""An engine that precompiled its set runs penalised, biased and logprob rows (with plain ones,
prefill, decode and a handoff's extend) without a trace, lowering or compile: the new step
arguments have the shapes and dtypes `precompile.dummy_batch` builds with, and the penalty
rows' seed program is built before serving."""

from pddjax.engines.paged_engine import EngineConfig, PagedEngine
from pddjax.engines.step import compile_count
from pddjax.kv.canonical import compiled_variants
from pddjax.model.sampling_params import SamplingParams
from tests.support.jax_events import jax_events
from tests.support.samples import prompt

MIX = [SamplingParams(), SamplingParams(0.9, 40, 0.95, 7), SamplingParams(presence_penalty=-1.0, frequency_penalty=0.5),
       SamplingParams(0.8, 0, 1.0, 2, repetition_penalty=1.3, logit_bias={7: 3.0, 9: -100.0}),
       SamplingParams(logprobs=True, top_logprobs=5), SamplingParams(0.7, 0, 1.0, 4, logprobs=True, top_logprobs=2,
                                                                     frequency_penalty=0.3)]


def test_penalised_biased_and_logprob_rows_compile_nothing_after_precompile(tiny, ref):
    # the suite's tiny table (configs/tiny.toml's): test_background_build builds this whole set first
    cfg = EngineConfig(page_size=16, num_pages=256, max_step_tokens=128, max_rows=8)
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, cfg)
    eng.precompile()
    before = compile_count() + compiled_variants()
    src = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, cfg)  # the same programs: built already
    calls, out = {}, {}

    def step(e):
        with jax_events() as seen:
            events = e.step()
        for k, n in seen.items():
            calls[k] = calls.get(k, 0) + n
        for ev in events:
            out.setdefault(ev.seq_id, []).append(ev.token)

    for wave in range(2):
        for i, params in enumerate(MIX):
            eng.add(f"{wave}/{i}", prompt(5 + 9 * i, 10 * wave + i), params, 8, ())
        src.add(f"{wave}/h", prompt(30, 99 + wave), MIX[2], 8, (), hold_on_finish=True)
        while len(src.seqs[f"{wave}/h"].generated) < 4:
            step(src)
        handed = src.seqs[f"{wave}/h"].generated[:4]
        eng.add(f"{wave}/h", prompt(30, 99 + wave), MIX[2], 8, ())
        eng.import_kv(f"{wave}/h", src.export_kv(f"{wave}/h", 0, 30))
        src.release(f"{wave}/h")
        eng.append_tokens(f"{wave}/h", 0, handed)
        out[f"{wave}/h"] = list(handed)
        while eng.has_work():
            step(eng)
    assert compile_count() + compiled_variants() == before
    assert not calls.get("trace_to_jaxpr") and not calls.get("lower_jaxpr_to_module"), calls
    assert not calls.get("pxla_cached_compilation"), calls
    assert eng.penalties.seed_calls >= 6  # (the rows were seeded: the program ran, built before)
    for i, params in enumerate(MIX):
        assert out[f"1/{i}"] == ref.generate(prompt(5 + 9 * i, 10 + i), params, 8, ()).token_ids, i
    assert out["1/h"] == ref.generate(prompt(30, 100), MIX[2], 8, ()).token_ids
