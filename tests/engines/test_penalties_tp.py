"""Penalties, logit_bias and logprobs at tensor parallel 2 (2 fake CPU devices, in a subprocess:
the device flag must precede JAX's start): the penalty tables live replicated on the mesh, the
seed program and the step run there, and tokens and logprobs equal the reference's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.paths import ROOT

SCRIPT = textwrap.dedent("""
    import os, json
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    from pddjax.model.jax_setup import configure
    configure("cpu")
    from pddjax.engines.engine_config import EngineConfig
    from pddjax.engines.paged_engine import PagedEngine
    from pddjax.engines.reference import ReferenceEngine
    from pddjax.engines import step
    from pddjax.model import weights as wm
    from pddjax.model.config import TINY
    from pddjax.model.sampling_params import SamplingParams
    from tests.support.samples import prompt

    cfg = TINY.replace(num_kv_heads=4)
    w = wm.init_random(cfg, 0)
    ref = ReferenceEngine(cfg, w)
    cases = {"pf": SamplingParams(presence_penalty=-1.5, frequency_penalty=0.7),
             "rep": SamplingParams(0.9, 40, 0.95, 3, repetition_penalty=1.6, logit_bias={11: 2.0}),
             "lp": SamplingParams(0.8, 0, 1.0, 5, frequency_penalty=0.4, logprobs=True, top_logprobs=5),
             "plain": SamplingParams()}
    prompts = {k: prompt(20, 300 + i) for i, k in enumerate(cases)}
    want = {k: ref.generate(prompts[k], p, 12, ()) for k, p in cases.items()}
    eng = PagedEngine(cfg, w, "fp", EngineConfig(page_size=8, num_pages=64, max_step_tokens=32, max_rows=4,
                                                 tensor_parallel=2))
    eng.precompile()
    before = step.compile_count()
    for k, p in cases.items():
        eng.add(k, prompts[k], p, 12, (), hold_on_finish=k == "pf")
    got = {}
    while eng.has_work():
        for ev in eng.step():
            got.setdefault(k := ev.seq_id, []).append(ev)
    out = {"tokens": {k: [e.token for e in got[k]] == want[k].token_ids for k in cases},
           "logprob_err": max(abs(e.logprobs.logprob - w.logprob) for e, w in zip(got["lp"], want["lp"].logprobs)),
           "top_ids": [[t for t, _ in e.logprobs.top] for e in got["lp"]] == [[t for t, _ in w.top]
                                                                            for w in want["lp"].logprobs],
           "replicated": eng.penalties.tables.counts.sharding.is_fully_replicated,
           "devices": len(eng.penalties.tables.counts.sharding.device_set)}
    # the switch on the mesh: a fresh engine admits pf's prompt KV and its first 9 tokens
    kv = eng.export_kv("pf", 0, 20)
    after = step.compile_count() - before
    md = PagedEngine(cfg, w, "fp", EngineConfig(page_size=16, num_pages=64, max_step_tokens=32, max_rows=4,
                                                tensor_parallel=2))
    md.precompile()
    before = step.compile_count()
    md.add("pf", prompts["pf"], cases["pf"], 12, ())
    md.import_kv("pf", kv)
    md.append_tokens("pf", 0, want["pf"].token_ids[:9])
    tail = []
    while md.has_work():
        tail += [ev.token for ev in md.step()]
    out["switch"] = want["pf"].token_ids[:9] + tail == want["pf"].token_ids
    out["compiles_after_precompile"] = after + step.compile_count() - before
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.timeout(600)
def test_penalties_and_logprobs_at_tp2_equal_the_reference():
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert all(r["tokens"].values()) and r["switch"], r
    assert r["logprob_err"] < 1e-5 and r["top_ids"], r
    assert r["replicated"] and r["devices"] == 2, r
    assert r["compiles_after_precompile"] == 0, r
