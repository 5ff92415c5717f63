"""The router over many instances: `pddjax up --instances 2,2,2` (tiny model, loopback), a
multi-turn trace of four sessions (two `auto`, two `pdd`):
  - every request's tokens equal the monolithic reference's;
  - each session stays on one MD and its DRC hit grows turn by turn, also across turns the
    singular filter finished on RLD (their context is synced to MD in the background);
  - one MD leaves (SIGTERM): health checks take it out of the rotation, its sessions move to
    the other MD (still exact tokens) and grow their hits there; the others keep theirs.
The router's link prior is made very slow (0.01 Mb/s) and the link is not probed (the
unshaped loopback would measure fast), so `auto` does not expect the delta in time: short
answers are singular traffic (filtered up to the 50% cap), the rest go pdd, until a transfer
large enough to measure throughput (>= 64 KB, after the move) corrects the estimate and `auto`
turns to pd-cross."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from pddjax.model.sampling_params import SamplingParams
from serving.client import Client, make_request
from tests.support.samples import prompt
from tests.support.serving_stack import launch_up, pid_alive
from tests.support.stack_checks import router_stats, wait_until

pytestmark = pytest.mark.timeout(400)

STACK = {
    "model": "tiny", "platform": "cpu",
    "engine": {"dtype": "float32", "page_size": 16, "num_pages": 256, "max_step_tokens": 128, "max_rows": 8},
    "router": {"chunk_bytes": 4096, "wan_mbps_prior": 0.01, "wan_probe": False, "filter_cap": 0.5,
               "health_interval_s": 0.3, "health_timeout_s": 1.0},
    "wan": {"mbps": 0, "latency_ms": 0},
}
SESSIONS = {"s0": "auto", "s1": "auto", "s2": "pdd", "s3": "pdd"}
MAX_TOKENS = 8


def start_up(request, workdir):
    """The `up` fixture's stack (tests/serving/conftest.py): two instances of each tier."""
    return launch_up(workdir, STACK, "--instances", "2,2,2")


def md_address(router: str, explain: str) -> str:
    """The MD a request used: explain names instances ("[P0, RLD0, MD1]"), never their addresses;
    the router's Stats maps names to addresses."""
    name = re.search(r"\b(MD\d+)\]", explain).group(1)
    return next(i["address"] for i in router_stats(router)["instances"] if i["name"] == name)


def test_up_starts_every_instance(up):
    s = up.read_state()
    roles = [x["role"] for x in s["services"]]
    assert sorted(roles) == ["main", "main", "prefill", "prefill", "relay", "relay", "router"]
    assert all(pid_alive(x["pid"]) for x in s["services"])
    assert len(s["wans"]) == 2 and s["wan"] == s["wans"][0]
    st = router_stats(s["router"])
    assert sorted(i["role"] for i in st["instances"]) == ["main", "main", "prefill", "prefill", "relay", "relay"]


class Trace:
    def __init__(self, up, ref):
        self.router, self.ref = up.state["router"], ref
        self.client = Client(self.router)
        self.context = {sid: prompt(40, 10 + i) for i, sid in enumerate(SESSIONS)}
        self.md: dict[str, list[str]] = {sid: [] for sid in SESSIONS}
        self.hit: dict[str, list[int]] = {sid: [] for sid in SESSIONS}
        self.pipelines: list[str] = []
        self.turn = 0

    def play(self):
        """One turn of every session: the whole context plus a new message."""
        for i, (sid, pipeline) in enumerate(SESSIONS.items()):
            p = self.context[sid] + prompt(16, 1000 * self.turn + i)
            r = self.client.generate(make_request(p, max_tokens=MAX_TOKENS, pipeline=pipeline, session_id=sid,
                                                  ignore_eos=True), timeout=240)
            assert r.token_ids == self.ref.generate(p, SamplingParams(), MAX_TOKENS, ()).token_ids, (sid, r.explain)
            self.md[sid].append(md_address(self.router, r.explain))
            self.hit[sid].append(int(re.search(r"MD (\d+)/(\d+)", r.explain).group(1)))
            self.pipelines.append(r.pipeline)
            if r.pipeline == "pd-local":  # filtered: wait for the background sync of its context to MD
                n = self.pipelines.count("pd-local")
                wait_until(lambda n=n: router_stats(self.router)["counters"].get("sync_main.done", 0) >= n, 60,
                           "context sync to MD")
            self.context[sid] = p + r.token_ids
        self.turn += 1


def full_pages(n):
    return n // 16 * 16


def test_sessions_keep_their_md_and_survive_one_md_leaving(up, ref):
    t = Trace(up, ref)
    try:
        for _ in range(3):
            t.play()
        assert "pd-local" in t.pipelines and "pdd" in t.pipelines  # the filter fired, and was capped
        assert len({t.md[sid][0] for sid in SESSIONS}) == 2  # sessions spread over both MDs
        for sid in SESSIONS:
            assert len(set(t.md[sid])) == 1, (sid, t.md[sid])  # affinity
            h = t.hit[sid]
            assert h[0] < h[1] < h[2], (sid, h)  # DRC hits grow across turns (filtered turns too)
            assert h[2] >= full_pages(40 + 16 + MAX_TOKENS + 16 + MAX_TOKENS - 1), (sid, h)
        st = router_stats(t.router)["counters"]
        assert st["hit_main_tokens"] >= st["hit_prefill_tokens"] > 0, st  # no drift: MD holds what P holds

        # one MD leaves: the one s0 is on
        gone = t.md["s0"][0]
        pid = next(x["pid"] for x in up.read_state()["services"] if x["address"] == gone)
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not next(i for i in router_stats(t.router)["instances"] if i["address"] == gone)["healthy"],
                   30, "the MD that left is out of the rotation")
        before = {sid: list(t.hit[sid]) for sid in SESSIONS}
        t.play()
        t.play()
        assert up.proc.poll() is None  # the stack keeps serving with one MD
        for sid in SESSIONS:
            assert t.md[sid][3] == t.md[sid][4] != gone, (sid, t.md[sid])
            if t.md[sid][0] == gone:  # moved: the new MD holds nothing of it at first, then grows
                assert t.hit[sid][3] < before[sid][2] and t.hit[sid][4] > t.hit[sid][3], (sid, t.hit[sid])
            else:  # stayed: hits keep growing
                assert t.hit[sid][3] > before[sid][2] and t.hit[sid][4] > t.hit[sid][3], (sid, t.hit[sid])
        c = router_stats(t.router)["counters"]
        print(t.pipelines, t.hit, t.md, c, sep="\n")
        assert c.get("health_left", 0) >= 1 and any(k.startswith("decision.") for k in c), c
    finally:
        t.client.close()


def test_generate_cli_plays_a_session(up, ref):
    """`pddjax generate --router ... --session-id ID --json`: two turns of one session from the
    shell; the JSON shows the pipeline and the explanation; turn two hits MD's DRC."""
    import subprocess
    import sys

    def turn(p):
        out = subprocess.run([sys.executable, "-m", "serving", "generate", "--router", up.state["router"],
                              "--prompt-ids", ",".join(map(str, p)), "--max-tokens", "6", "--session-id", "cli-1",
                              "--pipeline", "pdd", "--json"], capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    p1 = prompt(50, 77)
    j1 = turn(p1)
    assert j1["pipeline"] == "pdd" and j1["token_ids"] == ref.generate(p1, SamplingParams(), 6, (2,)).token_ids
    p2 = p1 + j1["token_ids"] + prompt(10, 78)
    j2 = turn(p2)
    assert j2["token_ids"] == ref.generate(p2, SamplingParams(), 6, (2,)).token_ids
    hit = int(re.search(r"MD (\d+)/", j2["explain"]).group(1))
    assert hit == full_pages(len(p1) + len(j1["token_ids"]) - 1), j2["explain"]
    assert re.search(r"\bMD\d+\]", j1["explain"]).group(0) == re.search(r"\bMD\d+\]", j2["explain"]).group(0)


def test_bad_instances_flag_is_one_sentence():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "serving", "up", "--instances", "2,0,1"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--instances" in out.stderr and out.stderr.count("\n") == 1, out.stderr
