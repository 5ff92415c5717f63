"""tools/kernel_ab: the native kernels of a git revision beside this tree's, on the tiny model.
Against HEAD's own kernels (this tree's, in a clean checkout) both sides run, each calls its own
build (the tool refuses a forward that does not), and the logits are bit for bit the same."""

from __future__ import annotations

import json
import subprocess

import pytest

from pddjax.model.attention import native_paged
from tools import kernel_ab

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not native_paged.available(), reason="no C++ compiler on this machine")]


def _kernels_changed() -> bool:
    paths = [*native_paged.SOURCES, *native_paged.HEADERS]
    done = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *paths], capture_output=True)
    return done.returncode != 0


def test_head_beside_this_tree_runs_both_builds(tmp_path):
    out = tmp_path / "ab.json"
    assert kernel_ab.main(["--rev", "HEAD", "--model", "tiny", "--shapes", "8,8,8,1", "4,1,8,4", "--context", "64",
                           "--num-pages", "128", "--reps", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["shapes"]
    assert [r["shape"] for r in rows] == [[8, 8, 8, 1], [4, 1, 8, 4]]
    assert all(r["ms"]["old"] > 0 and r["ms"]["new"] > 0 for r in rows)
    if not _kernels_changed():  # the same sources on both sides: the same sums
        assert all(r["bitwise_same"] for r in rows), rows


def test_an_unknown_revision_is_one_sentence():
    with pytest.raises(SystemExit) as e:
        kernel_ab.build_other("no-such-revision-anywhere", "/nonexistent")
    assert "kernel_ab" in str(e.value)
