"""tools/step_trace: one tiny-model step traced; the thunks it lists are the step's own (the page
gathers, the products and the layer loop among them), each with its time and the shape it
writes, and a shape the pool cannot hold is refused with one sentence."""

from __future__ import annotations

import re

import pytest

from tools import step_trace


def test_a_step_is_traced_and_its_thunks_named(capsys):
    assert step_trace.main(["--model", "tiny", "--shape", "8,8,8,1", "--context", "64", "--num-pages", "128",
                            "--reps", "2", "--top", "40"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.match(r"tiny forward \[8, 8, 8, 1\] at context 64: [\d.]+ ms a step", out[0])
    rows = [re.match(r"\s+([\d.]+) ms\s+x(\d+)\s+(\S+)\s*(.*)", line) for line in out[1:]]
    assert rows and all(rows), out
    assert any(r.group(3).startswith("while") for r in rows)  # the layer scan
    assert sum(float(r.group(1)) for r in rows) > 0
    # the gathered KV [KH, B, MP*S, D]: 2 kv heads, 8 rows, 8 pages of 16, head_dim 16
    assert any("[2,8,128,16]" in r.group(4) for r in rows), out


def test_a_shape_the_pool_cannot_hold_is_refused():
    with pytest.raises(SystemExit, match="and the pool the B rows' pages"):
        step_trace.main(["--model", "tiny", "--shape", "64,64,32,1", "--num-pages", "128"])
    with pytest.raises(SystemExit, match="in MP pages"):  # 64 + 1 tokens need 5 pages of 16
        step_trace.main(["--model", "tiny", "--shape", "1,1,4,1", "--context", "64"])


def test_the_native_attention_is_one_custom_call_a_layer(capsys):
    from pddjax.model.attention import native_paged

    if not native_paged.available():
        pytest.skip("no C++ compiler on this machine")
    assert step_trace.main(["--model", "tiny", "--shape", "8,8,8,1", "--context", "64", "--num-pages", "128",
                            "--reps", "2", "--top", "40", "--attention", "native"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [re.match(r"\s+([\d.]+) ms\s+x(\d+)\s+(\S+)\s*(.*)", line) for line in out[1:]]
    assert any(r.group(3).startswith("ffi_call") and int(r.group(2)) == 2 for r in rows), out  # 2 layers
    assert not any("[2,8,128,16]" in r.group(4) for r in rows), out  # no gathered KV
