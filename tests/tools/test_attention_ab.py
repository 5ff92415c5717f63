"""tools/attention_ab: XLA's attention and the native kernel side by side on the tiny model, in one
process: a time per side for each shape, and the two forwards agree (same argmax per row)."""

from __future__ import annotations

import json
import re

import pytest

from pddjax.model.attention import native_paged
from tools import attention_ab


@pytest.mark.skipif(not native_paged.available(), reason="no C++ compiler on this machine")
def test_two_sides_are_timed_and_agree(tmp_path, capsys):
    out = tmp_path / "ab.json"
    assert attention_ab.main(["--model", "tiny", "--shapes", "8,8,8,1", "24,2,8,16", "--context", "64",
                              "--num-pages", "128", "--reps", "2", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line in lines:
        assert re.match(r"\[\d+, \d+, 8, \d+\] xla [\d.]+ ms  native [\d.]+ ms  native/xla [\d.]+ ", line), line
    got = json.loads(out.read_text())
    assert [r["shape"] for r in got["shapes"]] == [[8, 8, 8, 1], [24, 2, 8, 16]]
    assert all(r["argmax_same"] and r["max_logit_diff"] < 1e-3 for r in got["shapes"]), got
