"""The stated step shape set (`buckets.bucket_set`): small, covers every step the scheduler can
form, and an engine that precompiled it runs a varied workload (mixed prompt lengths, decode
batches, KV imports and extend handoffs) in its members only, compiling nothing more."""

from __future__ import annotations

import numpy as np

from pddjax.engines import buckets
from pddjax.engines.engine_config import EngineConfig
from pddjax.engines.paged_engine import PagedEngine
from pddjax.engines.reference import ReferenceEngine
from pddjax.engines.step import compile_count
from pddjax.kv.canonical import compiled_variants
from pddjax.model.config import SMOLLM2_135M, TINY
from pddjax.model.sampling_params import SamplingParams

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=5)
TINY_TOML = EngineConfig(page_size=16, num_pages=256, max_step_tokens=128, max_rows=8)
PDDJAX_TOML = EngineConfig(page_size=16, num_pages=512, max_step_tokens=256, max_rows=16)


def prompt(n, seed):
    return np.random.default_rng(seed).integers(3, 512, n).tolist()


def test_the_set_is_small_and_stated():
    assert len(buckets.bucket_set(TINY_TOML, TINY)) == 22
    assert len(buckets.bucket_set(PDDJAX_TOML, SMOLLM2_135M)) == 90
    relay = EngineConfig(page_size=16, num_pages=256, max_step_tokens=256, max_rows=16)
    assert len(buckets.bucket_set(relay, SMOLLM2_135M)) == 74
    members = buckets.bucket_set(PDDJAX_TOML, SMOLLM2_135M)
    costs = [buckets.step_cost(m, 16) for m in members]
    assert costs == sorted(costs) and len(set(members)) == len(members)


def test_every_possible_step_fits_a_member():
    """Any step within the config's limits (tokens, rows, page width of the longest context)
    is covered: the scheduler never needs a shape outside the set."""
    rng = np.random.default_rng(0)
    for config, model in ((TINY_TOML, TINY), (PDDJAX_TOML, SMOLLM2_135M)):
        members = buckets.bucket_set(config, model)
        w_max = -(-min(model.max_context, (config.num_pages - 1) * config.page_size) // config.page_size)
        for _ in range(3000):
            rows = int(rng.integers(1, config.max_rows + 1))
            q = 1 if rng.random() < 0.3 else int(rng.integers(1, config.max_step_tokens - rows + 2))
            tokens = rows if q == 1 else int(rng.integers(q + rows - 1, config.max_step_tokens + 1))
            width = int(rng.integers(1, w_max + 1))
            m = buckets.fit(members, tokens, rows, width, q)
            assert m is not None and buckets.covers(m, tokens, rows, width, q), (tokens, rows, width, q)


def test_a_varied_workload_runs_only_members_and_compiles_nothing_after_precompile(tiny):
    ref = ReferenceEngine(tiny.config, tiny.weights)
    cfg = EngineConfig(page_size=16, num_pages=256, max_step_tokens=128, max_rows=8)
    p_eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, cfg)
    md = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, cfg)
    variants, seconds = md.precompile()
    assert variants >= len(md.shapes) and seconds > 0
    p_eng.precompile()  # the same shapes: loads nothing new
    before = compile_count() + compiled_variants()
    shapes = set()

    def step(eng):
        events = eng.step()
        assert eng.last_shape[:4] in eng.shapes, eng.last_shape
        shapes.add(eng.last_shape[:4])
        return events

    lengths = [3, 17, 40, 90, 150, 260, 7, 33]
    jobs = {f"r{i}": (prompt(n, i), SEEDED if i % 2 else GREEDY) for i, n in enumerate(lengths)}
    for rid, (p, params) in jobs.items():  # P: prefill, one token each, pages held for export
        p_eng.add(rid, p, params, 1, (), hold_on_finish=True)
    while any(not s.generated for s in p_eng.seqs.values()):
        step(p_eng)
    out = {}
    for i, (rid, (p, params)) in enumerate(jobs.items()):  # MD: KV import + handed-over token IDs
        known = ref.generate(p, params, 1 + 3 * i, ()).token_ids  # what RLD decoded before the handoff
        md.add(rid, p, params, 30, ())
        md.import_kv(rid, p_eng.export_kv(rid))
        p_eng.release(rid)
        md.append_tokens(rid, 0, known)
        out[rid] = list(known)
        for _ in range(i % 3):  # decode a little between arrivals: extends join decode rows
            for ev in step(md):
                out[ev.seq_id].append(ev.token)
    while md.has_work():
        for ev in step(md):
            out[ev.seq_id].append(ev.token)
    for rid, (p, params) in jobs.items():
        assert out[rid] == ref.generate(p, params, 30, ()).token_ids, rid
    assert compile_count() + compiled_variants() == before
    assert any(s[3] == 1 and s[1] > 1 for s in shapes) and any(s[3] > 1 and s[1] > 1 for s in shapes), shapes
