"""Serving before the whole shape set is built (`precompile(engine, "cover")`): the covering
set holds every step the scheduler can form, an engine on it alone is exact against the
monolithic reference, the background build adds the rest one by one (cheapest first) until the
engine runs the whole stated set, and nothing compiles on the request path meanwhile; with
PDDJAX_BACKGROUND_BUILD=0 (what the rest of the suite runs) the engine stays on the cover."""

from __future__ import annotations

import random
import threading

import pytest

from pddjax import env
from pddjax.engines import buckets, precompile, step
from pddjax.engines.engine_config import EngineConfig
from pddjax.engines.paged_engine import PagedEngine
from pddjax.engines.reference import ReferenceEngine
from pddjax.engines.step import compile_count, compile_count_foreground
from pddjax.kv import canonical, copies
from pddjax.kv.canonical import compiled_variants, compiled_variants_foreground
from pddjax.model.config import SMOLLM2_135M, TINY
from pddjax.model.sampling_params import SamplingParams
from tests.support.samples import prompt

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=5)
CONFIGS = {"tiny": (EngineConfig(page_size=16, num_pages=256, max_step_tokens=128, max_rows=8), TINY),
           "prefill / main": (EngineConfig(page_size=16, num_pages=512, max_step_tokens=256, max_rows=16),
                              SMOLLM2_135M),
           "relay": (EngineConfig(page_size=16, num_pages=256, max_step_tokens=256, max_rows=16), SMOLLM2_135M),
           "no pad limit": (EngineConfig(page_size=16, num_pages=256, max_step_tokens=128, max_rows=8, pad_limit=0),
                            TINY)}


@pytest.fixture(autouse=True)
def background_build_on(monkeypatch):
    """tests/conftest.py turns the background build off for the suite; this module tests it."""
    monkeypatch.setenv(env.BACKGROUND_BUILD.name, "1")


@pytest.fixture(autouse=True)
def fresh_process_tables(monkeypatch):
    """Each test starts on empty in-process tables of step executables and KV copies, so its
    compile counts do not depend on what earlier tests in this process (whichever ran first
    here, under pytest-xdist) left held; both are restored after."""
    fresh = copies.Copies()
    monkeypatch.setattr(step, "_executables", step.Executables(env.STEP_EXECUTABLES.get()))
    monkeypatch.setattr(copies, "copies", lambda: fresh)
    monkeypatch.setattr(canonical, "copies", lambda: fresh)


class Row:
    def __init__(self, n: int, start: int):
        self.num_pending, self.start = n, start


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_covering_set_is_small_and_every_step_packs_into_it(name):
    config, model = CONFIGS[name]
    stated = buckets.bucket_set(config, model)
    cover = buckets.covering_set(stated)
    assert set(cover) <= set(stated) and len(cover) <= 8, cover
    assert cover == sorted(cover, key=lambda s: buckets.step_cost(s, config.page_size))
    longest = buckets.max_width(config, model) * config.page_size
    rng = random.Random(7)
    for _ in range(300):  # random pending rows (decodes, chunks, long contexts): each step fits a member
        rows = [Row(rng.choice([1, 1, 1, rng.randint(2, 400)]), rng.randint(0, longest - 1))
                for _ in range(rng.randint(1, 40))]
        rows = [r for r in rows if r.start + 1 <= longest]
        picked, _ = buckets.pack_rows(cover, config.pad_limit, rows, config.max_step_tokens, config.max_rows,
                                      rng.random() < 0.5, config.page_size, lambda r: r.start)
        assert picked, "a step with pending rows took none"
        width = max(-(-(r.start + n) // config.page_size) for r, n in picked)
        shape = buckets.fit(cover, sum(n for _, n in picked), len(picked), width, max(n for _, n in picked))
        assert shape is not None, picked
    for n in (1, 5, 16, 100, config.max_step_tokens, 3 * config.max_step_tokens):  # a row alone: a full step
        for start in (0, longest // 2):
            if start + n > longest:
                continue
            alone = [Row(n, start)]
            got = [buckets.pack_rows(m, config.pad_limit, alone, config.max_step_tokens, config.max_rows, False,
                                     config.page_size, lambda r: r.start)[0] for m in (cover, stated)]
            assert got[0] == got[1], (n, start, got)
    for k in (1, 3, config.max_rows, 2 * config.max_rows):  # decode rows only: as many per step as the whole set
        rows = [Row(1, 30 * i) for i in range(k)]
        got = [len(buckets.pack_rows(m, config.pad_limit, rows, config.max_step_tokens, config.max_rows, False,
                                     config.page_size, lambda r: r.start)[0]) for m in (cover, stated)]
        assert got[0] == got[1] == min(k, config.max_rows), (k, got)


def run(eng: PagedEngine, ref: ReferenceEngine, jobs: dict, used: set) -> None:
    for rid, (p, params) in jobs.items():
        eng.add(rid, p, params, 12, ())
    out = {rid: [] for rid in jobs}
    while eng.has_work():
        for ev in eng.step():
            out[ev.seq_id].append(ev.token)
        used.add(eng.last_shape[:4])
    for rid, (p, params) in jobs.items():
        assert out[rid] == ref.generate(p, params, 12, ()).token_ids, rid


def hold_background(monkeypatch) -> threading.Event:
    """The background builder waits for the returned event before each step member and KV bucket."""
    go = threading.Event()
    for name in ("build_shape", "build_kv"):
        build = getattr(precompile, name)

        def held(*args, _build=build, **kw):
            if threading.current_thread().name == "background-build":
                assert go.wait(120)
            _build(*args, **kw)

        monkeypatch.setattr(precompile, name, held)
    return go


def test_an_engine_serves_on_the_cover_while_the_rest_builds_then_on_the_whole_set(tiny, monkeypatch):
    config, _ = CONFIGS["tiny"]
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, config)
    ref = ReferenceEngine(tiny.config, tiny.weights)
    go = hold_background(monkeypatch)  # steps run on the cover alone first
    eng.precompile("cover")
    cover = buckets.covering_set(eng.stated)
    assert eng.shapes == cover and eng.background is not None
    assert eng.background.pending == [s for s in eng.stated if s not in cover]
    kv = precompile.kv_buckets(eng)
    assert eng.background.kv_pending == [n for n in kv if n not in precompile.kv_cover(kv)] != []
    before, foreground = compile_count() + compiled_variants(), foreground_compiles()
    jobs = {f"r{i}": (prompt(n, i), SEEDED if i % 2 else GREEDY) for i, n in enumerate([3, 17, 40, 90, 150, 7])}
    used: set = set()
    run(eng, ref, jobs, used)
    assert used <= set(cover) and compile_count() + compiled_variants() == before, used
    go.set()
    assert eng.background.wait(300) and eng.background.error is None
    assert eng.shapes == eng.stated  # every member, in the set's own (cost) order
    assert eng.background.built == len(eng.stated) - len(cover)
    assert set(kv) <= set(copies.copies().buckets(eng.pool)) and copies.copies().pad(eng.pool, 40) == 64
    used = set()
    run(eng, ref, {f"s{k}": v for k, v in jobs.items()}, used)
    assert used - set(cover), "the whole set built, yet every step still took a covering member"
    assert compile_count() + compiled_variants() == before + eng.background.variants_built  # the builder's only
    assert foreground_compiles() == foreground  # every one of them counted as the builder's


def test_with_the_background_build_off_the_engine_serves_exact_on_the_cover_alone(tiny, monkeypatch):
    monkeypatch.setenv(env.BACKGROUND_BUILD.name, "0")
    config, _ = CONFIGS["tiny"]
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, config)
    eng.precompile("cover")
    cover = buckets.covering_set(eng.stated)
    assert eng.background is None and eng.shapes == cover != eng.stated
    before, foreground = compile_count() + compiled_variants(), foreground_compiles()
    jobs = {f"r{i}": (prompt(n, i), SEEDED if i % 2 else GREEDY) for i, n in enumerate([3, 17, 40, 90, 150, 7])}
    used: set = set()
    run(eng, ref=ReferenceEngine(tiny.config, tiny.weights), jobs=jobs, used=used)
    assert used <= set(cover) and len(used) > 1, used
    assert compile_count() + compiled_variants() == before and foreground_compiles() == foreground


def foreground_compiles() -> int:
    return compile_count_foreground() + compiled_variants_foreground()


def test_what_the_background_built_before_serving_never_counts_as_a_request_path_compile(tiny, monkeypatch):
    """The background build starts before the service reports SERVING: members it finished
    before then are in the count at ready and must not be taken off again (the gauge read -4),
    and a compile on the request path after ready still counts."""
    import asyncio

    from serving.engine.worker import EngineWorker

    config, _ = CONFIGS["tiny"]
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, config)
    gate, started = threading.Semaphore(3), []  # three builds before ready, the rest after
    for name in ("build_shape", "build_kv"):
        build = getattr(precompile, name)

        def gated(*args, _build=build, **kw):
            if threading.current_thread().name == "background-build":
                assert gate.acquire(timeout=120)
                started.append(args[-1])
            _build(*args, **kw)

        monkeypatch.setattr(precompile, name, gated)
    eng.precompile("cover")
    loop = asyncio.new_event_loop()
    worker = EngineWorker(eng, loop, name="engine-test")
    try:
        for _ in range(600):
            if eng.background.variants_built >= 4:  # two KV buckets (2 executables each) by now
                break
            threading.Event().wait(0.05)
        worker.mark_ready()
        assert eng.background.variants_built >= 4 and not eng.background.done.is_set()
        for _ in range(len(eng.stated) + 20):
            gate.release()
        assert eng.background.wait(300) and eng.background.error is None
        snap = worker.snapshot()
        assert snap["compiles_after_ready"] == 0 and snap["background_compiles"] == eng.background.variants_built
        T, B, MP, Q = eng.stated[0]
        precompile.build_shape(eng, (T, B, MP + 1, Q))  # a shape outside the set, built on this thread
        assert worker.snapshot()["compiles_after_ready"] == 1
    finally:
        worker.stop()
        loop.close()


def test_a_background_build_that_fails_leaves_the_engine_serving(tiny, monkeypatch, capsys):
    config, _ = CONFIGS["tiny"]
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, config)
    build, calls = precompile.build_shape, []

    def failing(engine, shape, **kw):
        if threading.current_thread().name == "background-build":
            calls.append(shape)
            if len(calls) == 3:
                raise MemoryError("no room for another executable")
        build(engine, shape, **kw)

    monkeypatch.setattr(precompile, "build_shape", failing)
    eng.precompile("cover")
    assert eng.background.wait(300)
    assert eng.background.built == 2 and "MemoryError" in eng.background.error
    assert f"background build stopped after {eng.background.variants_built} of" in capsys.readouterr().err
    run(eng, ReferenceEngine(tiny.config, tiny.weights), {"a": (prompt(30, 1), GREEDY)}, set())


def test_stop_ends_the_build_after_the_member_in_flight(tiny, monkeypatch):
    config, _ = CONFIGS["tiny"]
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, config)
    go = hold_background(monkeypatch)
    eng.precompile("cover")
    threading.Timer(0.2, go.set).start()
    assert eng.background.stop(120)  # waits for the member in flight, builds no other
    assert eng.background.done.is_set() and eng.background.error is None
    assert eng.background.variants_built <= 2 and eng.background.built == 0 < len(eng.background.pending)


def test_the_members_steps_padded_past_are_built_first(tiny, monkeypatch):
    """A short prompt on the cover alone pads every step to the widest page table; each step asks
    for its own member, and once the builder goes on those are built before any other member
    (first asked, first built), and the KV buckets wait behind them too."""
    config, _ = CONFIGS["tiny"]
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, config)
    go = hold_background(monkeypatch)
    order: list = []
    for name in ("build_shape", "build_kv"):
        build = getattr(precompile, name)

        def recorded(*args, _build=build, **kw):
            if threading.current_thread().name == "background-build":
                order.append(args[-1])
            _build(*args, **kw)

        monkeypatch.setattr(precompile, name, recorded)
    eng.precompile("cover")
    cover = buckets.covering_set(eng.stated)
    run(eng, ReferenceEngine(tiny.config, tiny.weights), {"a": (prompt(20, 3), GREEDY), "b": (prompt(5, 4), SEEDED)},
        set())
    asked = eng.background.asked
    assert asked and not set(asked) & set(cover), asked  # steps asked for members the cover lacks
    assert len(asked) == len(set(asked))
    assert set(asked) <= set(eng.stated)
    go.set()
    assert eng.background.wait(300) and eng.background.error is None
    # the builder held its first KV bucket (already in `order`) while the steps asked
    first_members = [x for x in order if isinstance(x, tuple)][:len(asked)]
    assert first_members == asked, (order[:len(asked) + 2], asked)
    assert order.index(asked[-1]) < next(i for i, x in enumerate(order[1:], 1) if isinstance(x, int))
    assert eng.shapes == eng.stated
    used: set = set()
    run(eng, ReferenceEngine(tiny.config, tiny.weights), {"c": (prompt(20, 3), GREEDY)}, used)
    assert used - set(cover), used  # the same request now runs its own members


def test_while_the_engine_is_busy_only_what_steps_ask_for_is_built(tiny):
    """Members no step asked for wait for an idle engine (`busy()` false) once the KV buckets are
    built (those go at once); a member a step asks for is built at once, busy or not."""
    config, _ = CONFIGS["tiny"]
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, config)
    busy = threading.Event()
    busy.set()
    eng.busy = busy.is_set  # as if requests were running from the start
    eng.precompile("cover")
    bg = eng.background
    for _ in range(600):
        if bg.kv_built == len(bg.kv_pending):
            break
        threading.Event().wait(0.05)
    threading.Event().wait(0.5)
    assert bg.kv_built == len(bg.kv_pending) and bg.built == 0 and not bg.done.is_set()
    member = bg.pending[-1]  # the costliest, last in the set's own order
    bg.want(member)
    for _ in range(600):
        if bg.built:
            break
        threading.Event().wait(0.05)
    threading.Event().wait(0.3)
    assert bg.built == 1 and member in eng.shapes, bg.built
    busy.clear()
    assert bg.wait(300) and bg.error is None and eng.shapes == eng.stated


def test_an_engine_is_busy_during_a_step_and_shortly_after(tiny):
    config, _ = CONFIGS["tiny"]
    eng = PagedEngine(tiny.config, tiny.weights, tiny.fingerprint, config)
    assert not eng.busy()
    seen = []
    eng._device_step = (lambda f: lambda *a, **k: (seen.append(eng.busy()), f(*a, **k))[1])(eng._device_step)
    eng.add("a", prompt(5, 1), GREEDY, 3, ())
    while eng.has_work():
        eng.step()
    assert seen and all(seen) and eng.busy()
    threading.Event().wait(precompile_idle_gap() + 0.05)
    assert not eng.busy()


def precompile_idle_gap() -> float:
    from pddjax.engines import paged_engine

    return paged_engine.IDLE_GAP


@pytest.mark.parametrize("n, on_cover, on_set", [(64, 16, 64), (5, 5, 5), (100, 100, 100), (300, 256, 256)])
def test_a_prompt_alone_is_not_padded_past_three_times_its_tokens_while_a_chunk_member_holds_part(n, on_cover, on_set):
    """The real model's cover has 16- and 256-token chunks at the widest table: a 64-token
    prompt there runs 16 tokens a step (padded to 256 it took 7.3 s against ~0.3 s a chunk);
    the whole set holds it in one step; a 5-token prompt has no tighter chunk and runs at once."""
    config, model = CONFIGS["prefill / main"]
    stated = buckets.bucket_set(config, model)
    for members, want in ((buckets.covering_set(stated), on_cover), (stated, on_set)):
        rows, _ = buckets.pack_rows(members, config.pad_limit, [Row(n, 0)], config.max_step_tokens,
                                    config.max_rows, False, config.page_size, lambda r: r.start)
        assert [k for _, k in rows] == [want]
