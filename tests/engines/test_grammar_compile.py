"""An engine that precompiled its set runs constrained rows (json_schema, regex, Lark; greedy and
seeded, beside plain, penalised and logprob rows, with prefill, decode and a handoff's extend)
without a trace, lowering or compile: the token mask is one more step argument of the shape and
dtype `precompile.dummy_batch` builds with, and a batch without constrained rows passes the same."""

from pddjax.engines.paged_engine import EngineConfig, PagedEngine
from pddjax.engines.reference import ReferenceEngine
from pddjax.engines.step import compile_count
from pddjax.grammar.spec import GrammarSpec
from pddjax.kv.canonical import compiled_variants
from pddjax.model.sampling_params import SamplingParams
from tests.grammar.tiny_vocab import compiler
from tests.support.jax_events import jax_events
from tests.support.samples import prompt

JSON = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer", "maximum": 50}},
                                "required": ["a"]})
MIX = [SamplingParams(grammar=JSON), SamplingParams(0.9, 40, 0.95, 7, grammar=GrammarSpec.regex("[a-z]{3,9}!")),
       SamplingParams(), SamplingParams(grammar=GrammarSpec.lark('start: "ok" | "no"'), logprobs=True, top_logprobs=2),
       SamplingParams(0.8, 0, 1.0, 2, presence_penalty=0.5, grammar=JSON), SamplingParams(logprobs=True)]


def test_constrained_rows_compile_nothing_after_precompile(tiny):
    # the suite's tiny table (configs/tiny.toml's): test_background_build builds this whole set first
    cfg = EngineConfig(page_size=16, num_pages=256, max_step_tokens=128, max_rows=8)
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, cfg, grammar=compiler())
    eng.precompile()
    src = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, cfg, grammar=compiler())
    for params in MIX:  # every grammar compiled before the count (a host build, no XLA)
        if params.grammar is not None:
            compiler().compile(params.grammar)
    before = compile_count() + compiled_variants()
    calls, out = {}, {}

    def step(e):
        with jax_events() as seen:
            events = e.step()
        for k, n in seen.items():
            calls[k] = calls.get(k, 0) + n
        for ev in events:
            out.setdefault(ev.seq_id, []).append(ev.token)
        e.check_integrity()

    for wave in range(2):
        for i, params in enumerate(MIX):
            eng.add(f"{wave}/{i}", prompt(5 + 9 * i, 10 * wave + i), params, 12, ())
        src.add(f"{wave}/h", prompt(30, 99 + wave), MIX[0], 12, (), hold_on_finish=True)
        while len(src.seqs[f"{wave}/h"].generated) < 4:
            step(src)
        handed = src.seqs[f"{wave}/h"].generated[:4]
        eng.add(f"{wave}/h", prompt(30, 99 + wave), MIX[0], 12, ())
        eng.import_kv(f"{wave}/h", src.export_kv(f"{wave}/h", 0, 30))
        src.release(f"{wave}/h")
        eng.append_tokens(f"{wave}/h", 0, handed)
        out[f"{wave}/h"] = list(handed)
        while eng.has_work():
            step(eng)
    assert compile_count() + compiled_variants() == before
    assert not calls.get("trace_to_jaxpr") and not calls.get("lower_jaxpr_to_module"), calls
    assert not calls.get("pxla_cached_compilation"), calls
    gref = ReferenceEngine(tiny.config, tiny.weights, grammar=compiler())
    for i, params in enumerate(MIX):
        assert out[f"1/{i}"] == gref.generate(prompt(5 + 9 * i, 10 + i), params, 12, ()).token_ids, i
    assert out["1/h"] == gref.generate(prompt(30, 100), MIX[0], 12, ()).token_ids
