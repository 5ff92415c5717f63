"""The stated step shape set (`buckets.bucket_set`): small, covers every step the scheduler can
form, and an engine that precompiled it runs a varied workload (mixed prompt lengths, decode
batches, KV imports and extend handoffs) in its members only, compiling nothing more."""

from __future__ import annotations

import collections

import numpy as np

from pddjax.engines import buckets
from pddjax.engines.engine_config import EngineConfig
from pddjax.engines.paged_engine import PagedEngine
from pddjax.engines.reference import ReferenceEngine
from pddjax.engines.step import compile_count
from pddjax.kv import copies
from pddjax.kv.canonical import compiled_variants
from pddjax.model.config import SMOLLM2_135M, TINY
from pddjax.model.sampling_params import SamplingParams
from tests.support.jax_events import jax_events
from tests.support.samples import prompt

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=5)
TINY_TOML = EngineConfig(page_size=16, num_pages=256, max_step_tokens=128, max_rows=8)
PDDJAX_TOML = EngineConfig(page_size=16, num_pages=512, max_step_tokens=256, max_rows=16)


def test_the_set_is_small_and_stated():
    assert len(buckets.bucket_set(TINY_TOML, TINY)) == 22
    assert len(buckets.bucket_set(PDDJAX_TOML, SMOLLM2_135M)) == 130
    relay = EngineConfig(page_size=16, num_pages=256, max_step_tokens=256, max_rows=16)
    assert len(buckets.bucket_set(relay, SMOLLM2_135M)) == 104
    members = buckets.bucket_set(PDDJAX_TOML, SMOLLM2_135M)
    costs = [buckets.step_cost(m, 16) for m in members]
    assert costs == sorted(costs) and len(set(members)) == len(members)
    mixed = {(T, B, Q) for T, B, _, Q in members if B > 1 and Q > 1}  # several rows of several tokens
    assert mixed == {(b * q, b, q) for b in (2, 4, 8, 16) for q in (16, 32, 64, 128) if b * q <= 256}
    unlimited = buckets.bucket_set(EngineConfig(page_size=16, num_pages=256, max_step_tokens=128, max_rows=8,
                                                pad_limit=0), TINY)
    assert {(T, B, Q) for T, B, _, Q in unlimited if B > 1 and Q > 1} == {  # the coarse Q = T members
        (16, 4, 16), (16, 8, 16), (64, 4, 64), (64, 8, 64), (128, 4, 128), (128, 8, 128)}
    # decode widths: the x2 ladder, and its x1.5 steps from 64 pages on
    assert {w for _, _, w, q in members if q == 1} == {8, 16, 32, 64, 96, 128, 192, 256, 384, 512}
    assert buckets.decode_widths(128) == [8, 16, 32, 64, 96, 128] and buckets.decode_widths(32) == [8, 16, 32]
    # a decode row of 65 .. 96 pages pads to 96, of 97 to 128
    assert [buckets.fit(members, 4, 4, w, 1)[2] for w in (64, 65, 96, 97)] == [64, 96, 96, 128]
    # chunk lengths: the x2 ladder and 192 (its x1.5 steps from 128 on); a 150-token tail takes 192
    assert sorted({t for t, b, _, q in members if b == 1 and q > 1}) == [16, 32, 64, 128, 192, 256]
    assert buckets.chunk_tokens(128) == [16, 32, 64, 128]
    assert buckets.fit(members, 150, 1, 70, 150)[::3] == (192, 192)
    assert buckets.fit_row(members, 0, 0, 0, 0, 900, 150, 16) == 150


def test_every_step_the_scheduler_can_form_fits_a_member():
    """Any step within the config's limits (tokens, rows, page width of the longest context)
    that `pads_past` lets through (with pad_limit 0: any step) is covered: the scheduler
    never needs a shape outside the set, and most such random steps are let through."""
    rng = np.random.default_rng(0)
    for config, model in ((TINY_TOML, TINY), (PDDJAX_TOML, SMOLLM2_135M),
                          (EngineConfig(page_size=16, num_pages=256, max_step_tokens=128, max_rows=8, pad_limit=0),
                           TINY)):
        members = buckets.bucket_set(config, model)
        w_max = -(-min(model.max_context, (config.num_pages - 1) * config.page_size) // config.page_size)
        checked = 0
        for _ in range(3000):
            rows = int(rng.integers(1, config.max_rows + 1))
            q = 1 if rng.random() < 0.3 else int(rng.integers(1, config.max_step_tokens - rows + 2))
            tokens = rows if q == 1 else int(rng.integers(q + rows - 1, config.max_step_tokens + 1))
            width = int(rng.integers(1, w_max + 1))
            if rows > 1 and q > 1:  # several rows, one of several tokens: the scheduler checks the padding
                prompt_rows = tokens >= q * rows // 2  # rows about as long as the longest: no decode rows
                fit = buckets.fit(members, tokens, rows, width, q)
                if fit is None or buckets.pads_past(members, config.pad_limit, rows, tokens, width, q,
                                                    not prompt_rows):
                    assert config.pad_limit > 0, (tokens, rows, width, q)
                    continue
            m = buckets.fit(members, tokens, rows, width, q)
            assert m is not None and buckets.covers(m, tokens, rows, width, q), (tokens, rows, width, q)
            checked += 1
        assert checked > 1000, checked  # decode steps (30%) and the mixed steps let through


def test_a_decode_only_step_takes_the_rows_the_row_by_row_packing_takes():
    """`pack_rows` takes a step of decode rows at once (`_decode_step`); on full sets, covering
    sets and sets missing the widest decode members, with rows near and past the limits, it
    picks exactly what packing row by row picks, and some of these cases fall back to it."""
    class Row:
        def __init__(self, start):
            self.start, self.num_pending = start, 1

    rng = np.random.default_rng(1)
    full = buckets.bucket_set(PDDJAX_TOML, SMOLLM2_135M)
    w_max = max(mp for _, _, mp, _ in full)
    narrow = [m for m in full if not (m[2] == w_max and m[1] >= 8)]  # no 8 rows at the widest table
    fell_back = 0
    for members in (full, buckets.covering_set(full), narrow):
        for _ in range(300):
            n = int(rng.integers(1, 3 * PDDJAX_TOML.max_rows))
            pending = [Row(int(rng.integers(0, w_max * 16))) for _ in range(n)]
            step_tokens, max_rows, start_of = int(rng.choice([4, 256])), PDDJAX_TOML.max_rows, lambda r: r.start
            args = (members, PDDJAX_TOML.pad_limit, pending, step_tokens, max_rows, bool(rng.random() < 0.5), 16,
                    start_of)
            fast = buckets._decode_step(members, pending, step_tokens, max_rows, 16, start_of)
            fell_back += fast is None
            row_by_row = buckets._pack_rows(*args)
            assert buckets.pack_rows(*args) == row_by_row
            assert fast is None or (fast, False) == row_by_row
    assert 0 < fell_back < 900, fell_back


def engine(tiny, **kw):
    cfg = dict(page_size=16, num_pages=256, max_step_tokens=256, max_rows=8) | kw
    return PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, EngineConfig(**cfg))


def test_an_extend_chunk_never_pads_a_decode_batch_and_never_waits_for_good(tiny):
    """MD with 6 requests decoding and one handoff's 20-token extend arriving: the decode rows
    step alone (Q = 1: the extend would pad 8 rows to Q = 32, ~4x the step on this CPU), the
    extend goes first in the next step, and every token equals the reference's."""
    ref = ReferenceEngine(tiny.config, tiny.weights)
    p_eng, md = engine(tiny), engine(tiny)
    prompts = {f"d{i}": prompt(24, 60 + i) for i in range(6)} | {"h": prompt(40, 70)}
    for rid, p in prompts.items():
        p_eng.add(rid, p, GREEDY, 1, (), hold_on_finish=True)
    while any(not s.generated for s in p_eng.seqs.values()):
        p_eng.step()
    expected = {rid: ref.generate(p, GREEDY, 30, ()).token_ids for rid, p in prompts.items()}
    out = {}
    for rid, p in prompts.items():
        md.add(rid, p, GREEDY, 30, ())
        md.import_kv(rid, p_eng.export_kv(rid))
        known = expected[rid][:20] if rid == "h" else [p_eng.seqs[rid].generated[0]]
        md.append_tokens(rid, 0, known)
        out[rid] = list(known)
    shapes = []
    while md.has_work():
        for ev in md.step():
            out[ev.seq_id].append(ev.token)
        shapes.append((md.last_shape, md.seqs["h"].pages.num_tokens if "h" in md.seqs else None))
    T, B, MP, Q, rows = shapes[0][0]
    assert (Q, rows) == (1, 6) and shapes[0][1] == 40  # the decodes alone; the extend's KV not computed
    assert shapes[1][0][3] > 1 and shapes[1][1] == 40 + 20  # the extend ran in the next step
    assert out == expected


def test_equal_prompts_share_a_step_with_q_below_t(tiny):
    """P with four 32-token prompts: one step of the member (128, 4, 32, 32) (the old set padded
    them to Q = T = 128 and refused it by pad_limit: four steps); tokens are the reference's."""
    ref = ReferenceEngine(tiny.config, tiny.weights)
    eng = engine(tiny)
    prompts = {f"p{i}": prompt(32, 80 + i) for i in range(4)}
    for rid, p in prompts.items():
        eng.add(rid, p, GREEDY, 1, ())
    events = eng.step()
    assert eng.last_shape == (128, 4, 32, 32, 4)
    assert {e.seq_id: e.token for e in events} == {rid: ref.generate(p, GREEDY, 1, ()).token_ids[0]
                                                   for rid, p in prompts.items()}


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

    calls: collections.Counter = collections.Counter()  # JAX events inside the steps

    def step(eng):
        with jax_events() as seen:
            events = eng.step()
        calls.update(seen)
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
    # the serving loop's calls hit what precompile built: no trace, lowering or compile of
    # anything (the step, its argument conversions, the KV copies), and each executable's Python
    # call path at most once (its first call sets up the C++ fast path), not once per step
    assert not calls["trace_to_jaxpr"] and not calls["lower_jaxpr_to_module"], calls
    assert not calls["pxla_cached_compilation"], calls
    kv_used = {copies.copies().pad(md.pool, n) for n in lengths}  # a gather on P, a scatter on MD each
    assert calls["stages_compiled_call"] <= len(shapes) + 2 * len(kv_used), (calls, len(shapes), kv_used)
    assert any(s[3] == 1 and s[1] > 1 for s in shapes) and any(s[3] > 1 and s[1] > 1 for s in shapes), shapes


def test_an_engine_builds_a_forward_per_member_and_a_sampler_per_row_count(tiny, monkeypatch):
    """The step is two programs (engines/step.py): the sampler depends on the row count alone, so
    a set of 22 members over 4 row counts is 22 forwards and 4 samplers, and the members a
    background build adds later are their forwards alone."""
    from pddjax.engines import precompile, step

    monkeypatch.setattr(step, "_executables", step.Executables(256))  # this engine's programs only
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, TINY_TOML)
    eng.precompile("cover")
    rows = {s[1] for s in eng.stated}
    held = step.executables()
    assert held.held("sample") == len(rows) == 4 and held.held("forward") == len(eng.shapes) < len(eng.stated)
    for shape in eng.stated:  # what the background build would do: one program each
        assert precompile.build_shape(eng, shape) == (shape not in eng.shapes), shape
    assert held.held("sample") == 4 and held.held("forward") == len(eng.stated) == 22
    held.check_integrity()



def test_long_rows_run_in_the_x1_5_members_with_the_reference_tokens(tiny):
    """The tiny model at a 2,048-token context: a 1,100-token prompt's decode rows (69-70 pages)
    run at width 96, not 128, and a 150-token tail after a cached 896-token prefix runs as one
    192-token chunk, not 256; every token is the reference's."""
    import dataclasses

    model_cfg = dataclasses.replace(tiny.config, max_context=2048)
    ref = ReferenceEngine(model_cfg, tiny.weights)
    eng = PagedEngine(model_cfg, tiny.weights, tiny.fingerprint,
                      EngineConfig(page_size=16, num_pages=256, max_step_tokens=256, max_rows=4))
    base = prompt(1100, 7)
    eng.add("long", base, GREEDY, 6, ())
    got, shapes = [], []
    while eng.has_work():
        got += [e.token for e in eng.step()]
        shapes.append(eng.last_shape[:4])
    assert got == ref.generate(base, GREEDY, 6, ()).token_ids
    decodes = [s for s in shapes if s[3] == 1]
    assert len(decodes) == 5 and {s[2] for s in decodes} == {96}  # 69-70 pages
    tail = base[:896] + prompt(150, 8)
    seq = eng.add("tail", tail, GREEDY, 2, ())
    assert seq.pages.num_cached == 896
    first = [e.token for e in eng.step()]
    assert eng.last_shape[:4] == (192, 1, 128, 192)  # 1,046 tokens: 66 pages, a chunk width of 128
    assert first + [e.token for e in eng.step()] == ref.generate(tail, GREEDY, 2, ()).token_ids
    eng.check_integrity()
