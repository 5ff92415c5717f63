"""Transfer faults and integrity (issue 8, points 4 and 5). One stack of real service processes
over loopback (2 P, 2 RLD, 2 MD, each MD behind its own emulated WAN link; tiny model); faults
come from the link (`pddjax.wan.emulator`: blackhole, flip, reset) or from SIGKILL.

Every request either ends token-identical to the monolithic reference or fails with a clear
status; none hangs (P's KV push has a no-progress timer, RLD's handoff a per-try timeout):
  - a KV chunk's checksum covers every field a receiver acts on;
  - the token-ID handoff is applied once per (request, chunk), also when RLD retries it after
    its connection was reset with MD's answer in flight;
  - a flipped byte on the WAN is DATA_LOSS, never decoded; pdd then finishes on RLD;
  - a blackholed WAN is detected within the push timer: pdd finishes on RLD, pd-cross fails
    with DEADLINE_EXCEEDED, and every tier is idle afterwards;
  - MD killed mid-transfer: the request completes on RLD and MD leaves the rotation;
  - RLD killed mid-decode: MD takes over from the tokens the user has;
  - P killed mid-request: the router retries on the other P; with no P left, UNAVAILABLE.
The kill tests run last and in this order (each leaves one instance of its role dead).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import signal
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

from pddjax.kv.canonical import KVRun
from pddjax.wan.emulator import A_TO_B, B_TO_A
from serving import kvwire
from serving.client import Client, make_request
from serving.pb import (
    cluster_pb2,
    cluster_pb2_grpc,
    common_pb2,
)
from serving.stack.up import spawn, stop_all, wait_ready
from tests.support import samples
from tests.support.samples import greedy
from tests.support.serving_stack import LinkThread
from tests.support.stack_checks import router_stats

pytestmark = pytest.mark.timeout(300)

STALL_S = 4.0  # P's no-progress timer on a KV push (PDDJAX_PUSH_STALL_SECONDS)
ENV = {"PDDJAX_PUSH_STALL_SECONDS": str(STALL_S), "PDDJAX_HANDOFF_TIMEOUT_SECONDS": "3",
       "PDDJAX_LEASE_SECONDS": "30"}
STACK = {"model": "tiny", "platform": "cpu",
         "engine": {"dtype": "float32", "page_size": 16, "num_pages": 256, "max_step_tokens": 128, "max_rows": 8},
         "router": {"chunk_bytes": 4096, "handoff_threshold": 48, "health_interval_s": 0.5}}
SOURCES = {common_pb2.ROLE_RELAY: "relay", common_pb2.ROLE_MAIN: "main"}


class FaultStack:
    """2 P, 2 RLD, 2 MD and a router as processes; P and RLD reach each MD through its own link
    (`links`), P reaches each RLD with KV through another (`relay_links`, unshaped)."""

    def __init__(self, workdir: str):
        self.children, self.links, self.relay_links = [], [], []
        self.log = open(os.path.join(workdir, "services.log"), "ab")  # noqa: SIM115  (closed in close())
        try:
            cfg = os.path.join(workdir, "stack.json")
            with open(cfg, "w") as f:
                json.dump(STACK, f)
            self.children = [spawn(r, cfg, workdir, log=self.log, name=f"{r}{k}")
                             for r in ("prefill", "relay", "main") for k in range(2)]
            asyncio.run(wait_ready(self.children, 240))
            addr = {r: [c.address for c in self.children if c.role == r] for r in ("prefill", "relay", "main")}
            self.links = [LinkThread(a) for a in addr["main"]]
            self.relay_links = [LinkThread(a) for a in addr["relay"]]
            rcfg = os.path.join(workdir, "router.json")
            with open(rcfg, "w") as f:
                json.dump({**STACK, "router": {**STACK["router"], **addr,
                                               "main_wan": [lk.address for lk in self.links],
                                               "relay_kv": [lk.address for lk in self.relay_links]}}, f)
            router = spawn("router", rcfg, workdir, log=self.log)
            self.children.append(router)
            asyncio.run(wait_ready([router], 240))
            self.router = router.address
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        stop_all(self.children)
        for lk in self.links + self.relay_links:
            lk.close()
        self.log.close()

    def child(self, address: str):
        return next(c for c in self.children if c.address == address)

    def live(self, role: str) -> list[str]:
        return [c.address for c in self.children if c.role == role and c.proc.poll() is None]

    def kill(self, address: str) -> None:
        c = self.child(address)
        c.proc.send_signal(signal.SIGKILL)
        c.proc.wait(timeout=30)

    def rpc_count(self, address: str, method: str) -> float:
        """Finished RPCs of `method` on a service (any status), from its /metrics."""
        with open(self.child(address).ready_file) as f:
            url = json.load(f)["metrics"]
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pddjax_rpc_total{") and f'method="{method}"' in line)

    def on_links(self, fn_name: str, *args, links=None, **kw) -> None:
        """Call emulator.fn_name on every link's event loop (faults touch sockets); `links`:
        which (default: the WAN links to MD)."""
        for lk in self.links if links is None else links:
            async def call(lk=lk):
                getattr(lk.link.emulator, fn_name)(*args, **kw)
            asyncio.run_coroutine_threadsafe(call(), lk.loop).result(10)

    def set_links(self, mbps: float = 0.0, latency_ms: float = 0.0) -> None:
        for lk in self.links:
            lk.set(mbps=mbps, latency_ms=latency_ms)

    def stats(self) -> dict:
        return router_stats(self.router)

    def assert_idle(self, timeout: float = 30.0) -> None:
        """Every live engine service holds no request and no page, and its integrity check holds."""
        deadline = time.monotonic() + timeout
        while True:
            busy = {}
            for role in ("prefill", "relay", "main"):
                for a in self.live(role):
                    with grpc.insecure_channel(a) as ch:
                        stub = (cluster_pb2_grpc.PrefillStub if role == "prefill" else cluster_pb2_grpc.DecodeStub)(ch)
                        i = stub.Info(cluster_pb2.InfoRequest(), timeout=10)
                    assert not i.integrity_error, (role, a, i.integrity_error)
                    if i.requests or i.pages_active:
                        busy[f"{role} {a}"] = (i.requests, i.pages_active)
            if not busy:
                return
            assert time.monotonic() < deadline, busy
            time.sleep(0.25)


class Run:
    """One streamed Generate: tokens, sources, the explain line, and how it ended."""

    def __init__(self):
        self.tokens, self.sources, self.explain = [], [], ""
        self.code, self.details, self.finish = None, "", None

    def address(self, tier: str, stack) -> str:
        """The address of the `tier` ("P", "RLD", "MD") this request used: the explain line names
        instances ("[P0, RLD1, MD0]"), never addresses; the router's Stats maps names to them."""
        name = re.search(rf"\b({tier}\d+)\b", self.explain).group(1)
        assert not re.search(r"\d+\.\d+\.\d+\.\d+:\d+|localhost:\d+", self.explain), self.explain
        return next(i["address"] for i in stack.stats()["instances"] if i["name"] == name)


def run(stack, req, on_message=None, timeout=120.0) -> Run:
    r, c = Run(), Client(stack.router)
    try:
        for msg in c.stream(req, timeout=timeout):
            r.explain = r.explain or msg.explain
            r.tokens += msg.token_ids
            r.sources += [SOURCES[s] for s in msg.sources]
            r.finish = r.finish or msg.finish_reason
            if on_message:
                on_message(r)
    except grpc.RpcError as e:
        r.code, r.details = e.code(), e.details()
    finally:
        c.close()
    return r


make_stack = FaultStack  # the `stack` fixture (tests/serving/conftest.py), started with ENV set
prompt = functools.partial(samples.prompt, vocab=500)  # this module's prompts: ids below 500


def assert_relay_then_main(sources):
    n = sources.count("relay")
    assert n >= 1 and sources == ["relay"] * n + ["main"] * (len(sources) - n), sources


# ---- integrity -------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["known_tokens", "start", "num_tokens", "last", "seq", "request_id", "k"])
def test_chunk_checksum_covers_every_field_a_receiver_acts_on(field):
    k = np.random.default_rng(0).standard_normal((2, 24, 2, 16)).astype(np.float32)
    pieces = kvwire.chunks("r", KVRun("fp", 0, k, -k, "float32"), 0, [7], 4096)  # 8 tokens per chunk
    c = pieces[-1]
    if field == "known_tokens":
        c.known_tokens[0] ^= 1  # P's first token, which the receiver would decode from
    elif field == "last":
        c.last = False
    elif field == "request_id":
        c.request_id = "s"
    elif field == "k":
        c.k = c.k[:-1] + bytes([c.k[-1] ^ 1])
    else:
        setattr(c, field, getattr(c, field) ^ 1)
    asm = kvwire.Assembler("fp")
    for good in pieces[:-1]:
        asm.feed(good)
    with pytest.raises(kvwire.WireError) as e:
        asm.feed(c)
    assert e.value.code_name == "DATA_LOSS" and "checksum" in str(e.value)


def test_handoff_tokens_are_applied_once_per_request_and_chunk(stack, ref):
    """MD keys the token-ID handoff by (request, chunk_seq | final): a repeat (RLD retrying after
    a lost answer) is answered like the first and changes nothing; the same key with tokens
    that disagree with MD's is refused. MD's stream then carries every later token exactly once."""
    p_addr, md_addr = stack.live("prefill")[0], stack.live("main")[0]
    rid, p = "once-1", prompt(40, 1)
    want = greedy(ref, p, 12)
    spec = cluster_pb2.SequenceSpec(request_id=rid, prompt=p, max_tokens=12, stop_token_ids=[])
    with grpc.insecure_channel(md_addr) as mch, grpc.insecure_channel(p_addr) as pch:
        md, pf = cluster_pb2_grpc.DecodeStub(mch), cluster_pb2_grpc.PrefillStub(pch)
        cached = md.Reserve(cluster_pb2.ReserveRequest(spec=spec, use_cache=True), timeout=30).cached_tokens
        target = cluster_pb2.KVTarget(address=md_addr, start=cached, role=common_pb2.ROLE_MAIN)
        events = list(pf.Prefill(cluster_pb2.PrefillRequest(spec=spec, targets=[target], chunk_bytes=4096), timeout=60))
        assert events[0].prefilled.first_token == want[0]
        assert [e.transfer_done.code for e in events[1:]] == [0]
        out: list = []
        reader = threading.Thread(target=lambda: out.extend(md.Decode(cluster_pb2.DecodeRequest(request_id=rid),
                                                                      timeout=60)))
        reader.start()

        def send(start, n, final, seq):
            return md.HandoffTokens(cluster_pb2.HandoffTokensRequest(
                request_id=rid, start_position=start, token_ids=want[start:start + n], final=final, chunk_seq=seq),
                timeout=30).caught_up_to

        first = send(0, 3, False, 0)
        assert send(0, 3, False, 0) == first >= 3  # a chunk, then its retry: the same answer
        assert send(3, 3, True, 1) == send(3, 3, True, 1)  # the final, then its retry
        with pytest.raises(grpc.RpcError) as e:  # another final for the same request, other tokens
            md.HandoffTokens(cluster_pb2.HandoffTokensRequest(
                request_id=rid, start_position=0, token_ids=[*want[:5], (want[5] + 1) % 512], final=True,
                chunk_seq=1), timeout=30)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # (another final that agrees with MD, the router taking over: tests/serving/engine/test_handoff_takeover.py)
        reader.join(60)
        md.Release(cluster_pb2.ReleaseRequest(request_id=rid, cancel=True), timeout=10)
    positions = [b.start_position for b in out if b.token_ids]
    tokens = [t for b in out for t in b.token_ids]
    assert positions[0] == 6 and tokens == want[6:], (positions, tokens)
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_handoff_retried_after_a_reset_lands_exactly_once(stack, ref):
    """RLD's final HandoffTokens reaches MD, MD applies it, and the answer is lost: the link
    holds MD's answers, then resets every connection. RLD retries the same (request, final) on
    a new connection; MD answers without applying it again (unless the router, which already
    gets MD's stream from the handoff point, moved to it and released RLD first). The user's
    tokens equal the reference, RLD's then MD's, with no token twice.

    Timing, L one way: the test sees P's last KV byte enter the link at t0; MD answers the push
    at ~t0 + L and RLD's handoff answer leaves MD at ~t0 + 3L, so holding answers from t0 + 2L on
    catches the handoff's only (if MD answers the push within L; RLD pauses once it sends the
    final, so it cannot finish meanwhile). A first request of the same session opens the RLD ->
    MD connection (none can be set up while answers are held) and pins P, RLD and MD."""
    warm = run(stack, make_request(prompt(40, 9), max_tokens=64, pipeline="pdd", ignore_eos=True,
                                   session_id="handoff-reset"))
    assert warm.code is None and warm.tokens == greedy(ref, prompt(40, 9), 64)
    try:
        for attempt, latency in enumerate((150, 300, 150, 300)):
            stack.set_links(latency_ms=latency)
            p = prompt(60, 10 + attempt)
            hands0 = {a: stack.rpc_count(a, "HandoffTokens") for a in stack.live("main")}
            sent0 = sum(lk.link.bytes_a_to_b for lk in stack.links)
            box: dict = {}
            req = make_request(p, max_tokens=440, pipeline="pdd", handoff="one-shot", ignore_eos=True,
                               session_id="handoff-reset")
            t = threading.Thread(target=lambda req=req, box=box: box.setdefault("run", run(stack, req)))
            t.start()
            stage, deadline = "push", time.monotonic() + 60
            while t.is_alive() and time.monotonic() < deadline and stage != "done":
                if stage == "push" and sum(lk.link.bytes_a_to_b for lk in stack.links) - sent0 >= 60 * 512:
                    time.sleep(2 * latency / 1e3)
                    stack.on_links("inject", B_TO_A, blackhole=True)  # MD's answers from now on are held
                    stage = "handoff"
                elif stage == "handoff" and any(stack.rpc_count(a, "HandoffTokens") > n for a, n in hands0.items()):
                    stack.on_links("inject", B_TO_A, reset=True)  # ... and lost: every connection is reset
                    stack.on_links("clear_faults")
                    stage = "done"
                time.sleep(0.005)
            stack.on_links("clear_faults")
            t.join(120)
            r = box["run"]
            assert r.code is None, (r.code, r.details)
            assert r.tokens == greedy(ref, p, 440)
            applied = sum(stack.rpc_count(a, "HandoffTokens") - n for a, n in hands0.items())
            if stage == "done" and "main" in r.sources:
                break
            print(f"attempt {attempt}: the fault missed the handoff (stage {stage}); again")
    finally:
        stack.set_links()
    assert_relay_then_main(r.sources)
    # MD applied the final once; its retry reaches MD only if RLD is still there: the router moves
    # the user's stream to MD as soon as MD's batches from the handoff point arrive, and then
    # releases RLD (a retry that does reach MD is answered, not applied: test above)
    assert applied >= 1, applied


def test_byte_flip_on_the_wan_is_detected_never_decoded(stack, ref):
    """One bit flipped inside the first KV chunk to MD (2,000 bytes into the push: past the
    HTTP/2 and gRPC headers, inside k): MD refuses the chunk (DATA_LOSS) and imports nothing
    after it. pdd finishes on RLD with the reference's tokens; pd-cross fails with DATA_LOSS."""
    p = prompt(60, 20)
    stack.on_links("inject", A_TO_B, flip_at=2000)
    r = run(stack, make_request(p, max_tokens=16, pipeline="pdd", ignore_eos=True))
    stack.on_links("clear_faults")
    assert r.code is None and r.tokens == greedy(ref, p, 16) and set(r.sources) == {"relay"}, (r.code, r.details)
    deadline = time.monotonic() + 10  # P's push fails on its own task: it may end after RLD's answer
    while stack.stats()["counters"].get("transfer_failed.main.DATA_LOSS", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.stats()["counters"].get("transfer_failed.main.DATA_LOSS", 0) >= 1

    stack.on_links("inject", A_TO_B, flip_at=2000)
    r = run(stack, make_request(prompt(60, 21), max_tokens=16, pipeline="pd-cross", ignore_eos=True))
    stack.on_links("clear_faults")
    assert r.code == grpc.StatusCode.DATA_LOSS and "checksum" in r.details and not r.tokens, (r.code, r.details)
    stack.assert_idle()


def test_corrupted_kv_to_rld_md_serves_the_request(stack, ref):
    """pdd: one bit flipped in P's push to RLD. RLD refuses the chunk (DATA_LOSS) and never
    decodes; MD, whose KV arrived intact, takes the request from P's first token and produces
    every other token, identical to the reference; every tier idle after."""
    p = prompt(60, 25)
    stack.on_links("inject", A_TO_B, flip_at=2000, links=stack.relay_links)
    try:
        r = run(stack, make_request(p, max_tokens=16, pipeline="pdd", ignore_eos=True))
    finally:
        stack.on_links("clear_faults", links=stack.relay_links)
    assert r.code is None and r.tokens == greedy(ref, p, 16), (r.code, r.details)
    assert set(r.sources[1:]) == {"main"}, r.sources  # token 0 is P's, forwarded at the takeover
    # RLD's Decode stream ends DATA_LOSS too; whichever report comes first, MD takes over once
    assert stack.stats()["counters"].get("main_took_over", 0) >= 1
    stack.assert_idle()


def test_blackholed_wan_is_detected_within_the_push_timer(stack, ref):
    stack.on_links("inject", A_TO_B, blackhole=True)
    try:
        p = prompt(60, 30)
        r = run(stack, make_request(p, max_tokens=24, pipeline="pdd", ignore_eos=True))
        assert r.code is None and r.tokens == greedy(ref, p, 24) and set(r.sources) == {"relay"}, (r.code, r.details)
        t0 = time.monotonic()
        r = run(stack, make_request(prompt(60, 31), max_tokens=24, pipeline="pd-cross", ignore_eos=True))
        took = time.monotonic() - t0
        assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED and "no progress" in r.details, (r.code, r.details)
        assert not r.tokens and took < STALL_S + 20, took
    finally:
        stack.on_links("clear_faults")
    stack.assert_idle()  # what the link held arrives now; the receivers drop it (released)
    p = prompt(50, 32)
    r = run(stack, make_request(p, max_tokens=8, pipeline="pd-cross"))
    assert r.code is None and r.tokens == greedy(ref, p, 8), (r.code, r.details)  # the link serves again


# ---- killed tiers (in this order: each leaves one instance of its role dead) -------------------
def _kill_after(stack, tier: str, tokens: int):
    def on_message(r):
        if len(r.tokens) >= tokens and not getattr(r, "killed", None):
            r.killed = r.address(tier, stack)
            stack.kill(r.killed)
    return on_message


def test_md_killed_mid_transfer_completes_on_relay(stack, ref):
    stack.set_links(mbps=0.5)  # 150 tokens of KV (77 KB) take ~1.2 s to cross
    try:
        p = prompt(150, 40)
        r = run(stack, make_request(p, max_tokens=300, pipeline="pdd", ignore_eos=True),
                on_message=_kill_after(stack, "MD", 1))
    finally:
        stack.set_links()
    assert r.code is None, (r.code, r.details)
    assert r.tokens == greedy(ref, p, 300) and set(r.sources) == {"relay"}
    st = stack.stats()
    assert any(k.startswith("transfer_failed.main.") for k in st["counters"]), st["counters"]
    assert [i["healthy"] for i in st["instances"] if i["address"] == r.killed] == [False]


def test_relay_killed_mid_decode_completes_on_main(stack, ref):
    stack.set_links(mbps=0.5)
    try:
        p = prompt(150, 50)
        r = run(stack, make_request(p, max_tokens=300, pipeline="pdd", ignore_eos=True),
                on_message=_kill_after(stack, "RLD", 3))
    finally:
        stack.set_links()
    assert r.code is None, (r.code, r.details)
    assert r.tokens == greedy(ref, p, 300)
    assert_relay_then_main(r.sources)
    assert stack.stats()["counters"].get("main_took_over", 0) >= 1


def test_prefill_killed_router_retries_then_unavailable(stack, ref):
    stack.set_links(mbps=0.5)  # P is still pushing MD's KV when it dies
    try:
        p = prompt(150, 60)
        kill, load = _kill_after(stack, "P", 1), []

        def on_message(r):
            if getattr(r, "killed", None):
                return
            kill(r)
            if getattr(r, "killed", None):  # poll the router at once: messages not yet read lag the stream
                deadline = time.monotonic() + 10
                while not load and time.monotonic() < deadline:
                    st = stack.stats()
                    if st["counters"].get("retry.prefill"):  # retried: the replacement carries the load
                        load.extend(i["inflight"] for i in st["instances"]
                                    if i["role"] == "prefill" and i["address"] != r.killed)
                    time.sleep(0.01)
        r = run(stack, make_request(p, max_tokens=300, pipeline="pdd", ignore_eos=True), on_message=on_message)
    finally:
        stack.set_links()
    assert r.code is None, (r.code, r.details)
    assert r.tokens == greedy(ref, p, 300)
    stats = stack.stats()
    assert stats["counters"].get("retry.prefill", 0) >= 1
    assert load == [1]  # the replacement P counted this request while serving it...
    assert all(i["inflight"] == 0 for i in stats["instances"]), stats["instances"]  # ...and gave it back
    (last,) = stack.live("prefill")
    stack.kill(last)
    for pipeline in ("pd-cross", "pdd"):
        t0 = time.monotonic()
        r = run(stack, make_request(prompt(30, 61), max_tokens=8, pipeline=pipeline))
        assert r.code == grpc.StatusCode.UNAVAILABLE and "prefill" in r.details, (r.code, r.details)
        assert time.monotonic() - t0 < 10
    stack.assert_idle()  # the survivors hold nothing
