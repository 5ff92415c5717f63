"""tools/soak.py can fail (issue 17): its verdict names every breach of its bounds (tokens, errors,
a tier not idle after the load, RSS growth past the bound), and a short run on a healthy tiny
stack passes with exit code 0 and the figures printed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.paths import ROOT
from tools.soak import RSS_GROWTH_MB, verdict


def healthy() -> dict:
    idle = {"requests": 0, "pages": 0, "integrity_error": ""}
    return {"counts": {"completed": 40, "aborted": 12, "mismatched": 0, "errors": 0},
            "rss_mb": {r: {"start": 300.0, "warm": 400.0, "end": 410.0, "max": 415.0}
                       for r in ("prefill", "relay", "main", "router")},
            "after": {r: dict(idle) for r in ("prefill", "relay", "main")}}


def test_verdict_passes_a_healthy_run_and_fails_on_each_breach():
    assert verdict(healthy()) == []
    f = healthy()
    f["rss_mb"]["main"]["end"] = 400.0 + RSS_GROWTH_MB + 1  # grew past the bound after the warm-up
    assert verdict(f) == [f"main RSS grew {RSS_GROWTH_MB + 1:.0f} MB after the warm-up (400 -> "
                          f"{400 + RSS_GROWTH_MB + 1:.0f} MB), more than {RSS_GROWTH_MB:g}"]
    f = healthy()
    f["rss_mb"]["main"]["end"] = 400.0 + RSS_GROWTH_MB  # at the bound: passes
    assert verdict(f) == []
    f = healthy()
    f["after"]["relay"].update(requests=1, pages=3)
    assert verdict(f) == ["relay still holds 1 requests and 3 pages after the load"]
    f = healthy()
    f["after"]["main"]["pages"] = 2  # a page leaked without its request
    assert len(verdict(f)) == 1
    f = healthy()
    f["after"]["prefill"]["integrity_error"] = "refcount"
    assert verdict(f) == ["prefill fails its integrity check: refcount"]
    f = healthy()
    f["counts"].update(mismatched=1, errors=2)
    assert verdict(f) == ["1 requests' tokens differ from the reference", "2 requests failed"]
    f = healthy()
    f["counts"]["completed"] = 0
    assert verdict(f) == ["no request completed"]


@pytest.mark.timeout(600)
def test_a_short_soak_passes(tmp_path):
    """Six seconds of 4 sessions (30% aborted) on the small stack, sampled every 2 s, warm after the
    first sample."""
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "tools/soak.py", "--small", "--minutes", "0.1", "--sessions", "4",
                           "--sample-seconds", "2", "--warmup-seconds", "2", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    print(json.dumps({k: figures[k] for k in ("counts", "rss_mb", "after")}))
    assert figures["failures"] == [] and figures["counts"]["completed"] > 0
    assert set(figures["rss_mb"]) == {"prefill", "relay", "main", "router"}
    assert all(t["pages"] == 0 and t["requests"] == 0 for t in figures["after"].values())
    assert '"failures": []' in proc.stdout  # the figures are printed
