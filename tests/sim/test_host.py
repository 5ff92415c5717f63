"""The one-host model behind the host lab's validation (`python -m tools.hostlab.validate`):
shared cores, engine steps, P's scheduling, KV streams, and the benchmark's two-phase replay.
Cases are small enough to check by hand (times in seconds)."""

import pytest

from pddjax.sim.cache import PrefixCache
from pddjax.sim.cluster import Cluster
from pddjax.sim.config import ClusterConfig, HostConfig, Pool
from pddjax.sim.decode import DecodeInstance, Seq
from pddjax.sim.engine_prefill import EnginePrefill
from pddjax.sim.engine_steps import StepModel, kv_slots
from pddjax.sim.events import EventLoop, SimError
from pddjax.sim.host import Host
from pddjax.sim.lineage import Lineage
from pddjax.sim.measured import MeasuredInstance
from pddjax.sim.request import SimRequest
from pddjax.sim.streams import KVStream
from pddjax.sim.wan import Line
from pddjax.workload.trace import TraceRequest

# Every step takes 0.1 s whatever its shape (one table point; the 512-token prefill too).
FLAT = MeasuredInstance.from_json({"decode_ms": {"1": 100}, "extend_ms": {"1": 100}, "prefill_tokens_per_s": 5120,
                                   "kv_bytes_per_token": 1000})


def finish_times(cores, jobs):
    """Run (start, work, cores) jobs on a host; their finish times."""
    loop, done = EventLoop(), {}
    host = Host(loop, cores)
    for i, (start, work, c) in enumerate(jobs):
        loop.at(start, lambda i=i, w=work, c=c: host.run(w, c, lambda: done.setdefault(i, loop.now)))
    loop.run()
    host.check_integrity()
    return [done[i] for i in range(len(jobs))]


@pytest.mark.parametrize("cores, jobs, expected", [
    (2, [(0, 1, 1), (0, 1, 1)], [1, 1]),  # two one-core jobs on two cores: no slowdown
    (2, [(0, 1, 1)] * 3, [1.5, 1.5, 1.5]),  # three on two: each at 2/3
    (2, [(0, 1, 2), (0, 1, 2)], [2, 2]),  # two jobs that each want the whole host: each at 1/2
    (2, [(0, 2, 1), (1, 1, 1), (1, 1, 1)], [2.5, 2.5, 2.5]),  # A has 1 s left at t=1, then all at 2/3
    (1, [(0, 1, 1), (0, 3, 1)], [2, 4]),  # processor sharing: the short job leaves, the long speeds up
])
def test_host_processor_sharing(cores, jobs, expected):
    assert finish_times(cores, jobs) == pytest.approx(expected)


def test_step_model_reproduces_the_profile_and_adds_context():
    prof = {"decode_ms": {"1": 40, "8": 120}, "extend_ms": {"1": 45, "16": 70, "64": 180},
            "prefill_tokens_per_s": 500, "context": 256, "page_size": 16}
    flat = StepModel(MeasuredInstance.from_json(prof))
    ctx = StepModel(MeasuredInstance.from_json({**prof, "attention_ns_per_pair": 2000, "gather_ns_per_slot": 5000}))
    for m in (flat, ctx):  # at the profile's own points the profile's times come back
        assert m.step_s(decode_rows=1, decode_kv=256 + 16) == pytest.approx(0.040)
        assert m.step_s(decode_rows=8, decode_kv=256 + 16) == pytest.approx(0.120)
        assert m.step_s(chunks=[(64, 256 + 64)]) == pytest.approx(0.180)
        assert m.step_s(chunks=[(512, 512)]) == pytest.approx(1.024)
    # a 256-token chunk at context 768 costs a * 256 * dC + g * dC more than at context 0
    dc = kv_slots(1024, 16) - kv_slots(256, 16)
    assert dc == 768
    d = ctx.step_s(chunks=[(256, 1024)]) - ctx.step_s(chunks=[(256, 256)])
    assert d == pytest.approx(2e-6 * 256 * 768 + 5e-6 * 768)
    assert flat.step_s(chunks=[(256, 1024)]) == flat.step_s(chunks=[(256, 256)])
    assert len(ctx.shapes) == 6  # (T, B, width, Q) buckets seen


def req(sid, prompt, prefix=0, turn=0, output=4):
    return SimRequest(TraceRequest(f"s{sid}-t{turn}", sid, turn, 0.0, 0.0, 0, 2000, 1, prefix, prompt - prefix,
                                   prompt, output, output))


def prefill(host_cores=2.0, step_cores=1.0, pad_limit=1.5):
    loop = EventLoop()
    host = Host(loop, host_cores)
    hc = HostConfig(cores=host_cores, step_cores=step_cores, step_tokens=256, max_rows=16, pad_limit=pad_limit)
    chunks, done = [], {}
    lin = Lineage()
    p = EnginePrefill(loop, "p0", FLAT, lin, host, hc, lambda r, a, b, last: chunks.append((r.rid, a, b, last)),
                      lambda r: done.setdefault(r.rid, loop.now))
    return loop, host, p, lin, chunks, done


@pytest.mark.parametrize("pad_limit", [1.5, 0.0])
def test_prefill_packs_steps_fewest_pending_first(pad_limit):
    """Fewest pending first, each row as many tokens as still fit a member of the engine's set
    (as `PagedEngine.step`; checked against it on these and 5 more cases): with the pad limit
    the cold prompt joins the hot turn's 50 tokens with 128 (the mixed member (256, 2, MP, 128):
    2 x 128 <= 1.5 x 178; the old prompt-row rule padded Q to 256 and ran the hot turn alone),
    then full steps. Without a limit the coarse Q = T member takes 50 + 206."""
    loop, _, p, lin, chunks, done = prefill(pad_limit=pad_limit)
    cold, hot = req(1, 600), req(2, 50)
    for r in (cold, hot):
        lin.add(r.sid, 0, 0)
        p.submit(r)
    loop.run()
    if pad_limit:  # steps: hot 50 + cold 128 | 256 | 216 (FLAT: 0.1 s each)
        assert done == pytest.approx({"s2-t0": 0.1, "s1-t0": 0.3})
        assert chunks == [("s2-t0", 0, 50, True), ("s1-t0", 0, 128, False), ("s1-t0", 128, 384, False),
                          ("s1-t0", 384, 600, True)]
    else:  # steps: hot 50 + 206 of cold | 256 | 138
        assert done == pytest.approx({"s2-t0": 0.1, "s1-t0": 0.3})
        assert chunks == [("s2-t0", 0, 50, True), ("s1-t0", 0, 206, False), ("s1-t0", 206, 462, False),
                          ("s1-t0", 462, 600, True)]
    assert p.n_steps == 3
    p.check_integrity()


@pytest.mark.parametrize("prompts, steps", [
    ((5, 32), [["s0-t0"], ["s1-t0"]]),  # 2 x 32 > 1.5 x 37: apart (the old rule: 64 <= 1.5 x 64, together)
    ((40, 40, 40), [["s0-t0"], ["s1-t0"], ["s2-t0"]]),  # 2 x 64 > 1.5 x 80 (old: 128 <= 1.5 x 128)
    ((1, 16, 200), [["s0-t0", "s1-t0", "s2-t0"], ["s2-t0"]]),  # a 1-token row: MIXED_PAD, 64 of 200 ride along
])
def test_prefill_steps_follow_the_engines_padding_rule(prompts, steps):
    loop, _, p, lin, _, _ = prefill()
    seen: dict = {}  # step end time -> the requests in that step, in row order
    p.on_chunk = lambda r, a, b, last: seen.setdefault(loop.now, []).append(r.rid)
    for i, n in enumerate(prompts):
        lin.add(i, 0, 0)
        p.submit(req(i, n))
    loop.run()
    assert [seen[t] for t in sorted(seen)] == steps


def test_prefill_reuses_whole_pages_and_streams_the_cached_part_first():
    loop, _, p, lin, chunks, _ = prefill()
    first = req(1, 500)
    lin.add(1, 0, 0)
    p.submit(first)
    loop.run()
    second = req(1, 530, prefix=500, turn=1)  # extends turn 0's 500-token prompt, which P holds
    lin.add(1, 1, 500)
    assert p.hit_for(second) == 496  # 31 whole pages of 16
    p.submit(second)
    loop.run()
    assert chunks[-2:] == [("s1-t1", 0, 496, False), ("s1-t1", 496, 530, True)]


def test_engines_on_one_core_slow_each_other_down():
    loop, host, p, lin, _, done = prefill(host_cores=1.0, step_cores=1.0)
    d = DecodeInstance(loop, "d0", FLAT, PrefixCache(10**6), 16, True, host, 1.0)
    r = req(1, 700)
    lin.add(1, 0, 0)
    p.submit(r)  # 3 steps of 0.1 s alone
    other = req(9, 10, output=4)
    finished = {}
    seq = Seq(other, 20, 10, 3, True, on_admit=lambda s: None, on_finish=lambda s: finished.setdefault("d", loop.now))
    d.enqueue(seq)  # 3 decode steps of 0.1 s alone, at the same time
    loop.run()
    assert finished["d"] == pytest.approx(0.6) and done["s1-t0"] == pytest.approx(0.6)  # both at half speed
    assert host.busy_s == pytest.approx(0.6)


def test_line_stream_shares_only_while_it_has_bytes():
    loop, done = EventLoop(), {}
    line = Line(loop, gbps=8e-6, latency_s=0.0)  # 1,000 bytes/s
    s = line.open(lambda: done.setdefault("s", loop.now))
    line.feed(s, 500)  # alone: 0.5 s
    loop.at(1.0, lambda: line.send(1000, lambda: done.setdefault("t", loop.now)))
    loop.at(1.0, lambda: line.feed(s, 500, last=True))  # shares with t from 1.0: both at 500 B/s
    loop.run()
    assert done["s"] == pytest.approx(2.0)  # its last 500 B at half the line
    assert done["t"] == pytest.approx(2.5)  # 500 B shared until 2.0, the rest alone
    assert s.sent == 1000 and line.bytes_sent == 2000


def trace_one_session():
    """History turn at -5, then turns at 0 and 0.2 (think 0.5); 1,600-token contexts."""
    rows = [(0, -5.0, 0.0, 1500, 100), (1, 0.0, 0.0, 1580, 20), (2, 0.2, 0.5, 1600, 16)]
    out, prev = [], 0
    for turn, at, think, prefix, new in rows:
        out.append(TraceRequest(f"s0-t{turn}", 0, turn, at, think, 0, 1500, 7, min(prefix, 1500 if turn == 0 else prev),
                                new, min(prefix, 1500 if turn == 0 else prev) + new, 8, 8))
        prev = out[-1].prompt_tokens + 8
    return out


def test_history_replays_first_then_measured_turns_close_the_loop():
    hc = HostConfig(cores=2.0, step_cores=1.0, unshaped_gbps=1.0)
    cfg = ClusterConfig("pd-local", Pool(FLAT, 1), Pool(FLAT, 1), user_lag_s=0.0, host=hc)
    cl = Cluster(cfg, trace_one_session(), horizon=float("inf"), replay_history=True)
    done = sorted(cl.run(), key=lambda r: r.turn)
    t0 = cl.t0
    assert t0 == pytest.approx(done[0].finish)  # the measured phase opens when history is done
    assert done[1].arrival == pytest.approx(t0)  # turn 1 at its arrival_s = 0 after t0
    assert done[2].arrival == pytest.approx(max(t0 + 0.2, done[1].finish + 0.5))  # closed loop
    assert [r.rid for r in cl.measured()] == ["s0-t1", "s0-t2"]
    assert done[1].p_hit == 1568  # P holds turn 0's 1,600-token prompt; 1,580 shared -> 98 pages
    cl.check_integrity()


def test_fifo_line_stream_queues_each_feed_behind_earlier_bytes():
    loop, done = EventLoop(), {}
    line = Line(loop, gbps=8e-6, latency_s=0.0, sharing="fifo")  # 1,000 bytes/s, one at a time
    s = line.open(lambda: done.setdefault("s", loop.now))
    line.feed(s, 500)
    loop.at(0.2, lambda: line.send(1000, lambda: done.setdefault("t", loop.now)))
    loop.at(0.3, lambda: line.feed(s, 500, last=True))  # queues behind t
    loop.run()
    assert done == pytest.approx({"t": 1.5, "s": 2.0})


def kv_import_landing(busy: bool, tokens: int = 100) -> float:
    """When a KV push of `tokens` from P lands on a local D that is (or is not) decoding.
    Chunks of 45 tokens arrive at once: the first is imported by one call, the rest, which
    arrived while that call waited, by the next call together, then the call that completes it."""
    hc = HostConfig(cores=2.0, step_cores=1.0, decode_cores=1.0, chunk_bytes=45_000)
    cfg = ClusterConfig("pd-local", Pool(FLAT, 1), Pool(FLAT, 1), user_lag_s=0.0, host=hc)
    cl = Cluster(cfg, trace_one_session(), horizon=float("inf"))
    d = cl.D[0]
    if busy:  # a sequence decoding 50 tokens: back-to-back 0.1 s steps
        d.enqueue(Seq(req(5, 10, output=50), 60, 10, 49, True, on_admit=lambda s: None, on_finish=lambda s: None))
    r = req(1, tokens)
    r.p_inst = cl.P[0]
    landed = {}
    stream = KVStream(cl, r, d, cl.fast[0], 0, lambda q: landed.setdefault("t", cl.loop.now))
    cl.loop.at(0.05, stream.chunk, 0, tokens, True)  # mid-step when busy
    cl.loop.run()
    return landed["t"]


def test_kv_imports_are_coalesced_while_the_receiver_steps():
    assert kv_import_landing(busy=False) == pytest.approx(0.05)  # idle receiver: calls run at once
    assert kv_import_landing(busy=True) == pytest.approx(0.3)  # three calls, each after a 0.1 s step
    assert kv_import_landing(busy=True, tokens=1000) == pytest.approx(0.3)  # 23 chunks, still three calls


@pytest.mark.parametrize("mode", ["pd-local", "pdd"])
def test_a_tier_in_a_receives_only_what_its_own_cache_lacks(mode):
    """Turn 0 (1,600 tokens + 8 out) is cached where it was decoded (local D, or RLD, which
    caches what it served); turn 1 shares 1,580 tokens with it: P sends from 1,568 (whole pages)."""
    hc = HostConfig(cores=2.0, step_cores=1.0, unshaped_gbps=1.0)
    extra = {"rld": Pool(FLAT, 1), "rld_threshold_s": 0.0, "rld_normal_path": True} if mode == "pdd" else {}
    cfg = ClusterConfig(mode, Pool(FLAT, 1), Pool(FLAT, 1), user_lag_s=0.0, host=hc, **extra)
    cl = Cluster(cfg, trace_one_session(), horizon=float("inf"), replay_history=True)
    done = sorted(cl.run(), key=lambda r: r.turn)
    cl.check_integrity()
    assert [r.pipeline for r in done] == ["P-D"] * 3 if mode == "pd-local" else ["P-RLD"] * 3
    assert [r.streams[0].start for r in done] == [0, 1568, 1600]  # turn 2 shares 1,600 of turn 1's 1,608
    assert [r.streams[0].tokens for r in done] == [1600, 32, 16]


def wan_push_seconds(timing: str) -> float:
    """The link sample of a 900-token push that P exports in three pieces 1 s apart on a line
    that carries 600 tokens per second: each piece leaves in 0.5 s and the last is delivered
    at 2.5 s; 'wire' leaves out the 2 x 0.5 s its sender had nothing to send (waited for P)."""
    hc = HostConfig(cores=8.0, step_cores=1.0, push_window_bytes=0.0)
    cfg = ClusterConfig("pd-cross", Pool(FLAT, 1), Pool(FLAT, 1), wan_gbps=600 * 1000 * 8 / 1e9, wan_latency_s=0.0,
                        wan_jitter_s=0.0, wan_sharing="fifo", link_timing=timing, host=hc)
    cl = Cluster(cfg, trace_one_session(), horizon=float("inf"))
    r = req(1, 900)
    r.p_inst = cl.P[0]
    samples = []

    class Estimator:
        def start(self, nbytes): pass

        def done(self, planned, nbytes, seconds, ok=True):
            samples.append(seconds)

    stream = KVStream(cl, r, cl.D[0], cl.wan, 0, lambda q: None, estimator=Estimator())
    for i in range(3):
        cl.loop.at(float(i), stream.chunk, 300 * i, 300 * (i + 1), i == 2)
    cl.loop.run()
    return samples[0]


def test_link_samples_leave_out_the_wait_on_p_with_wire_timing():
    assert wan_push_seconds("admission") == pytest.approx(2.5)
    assert wan_push_seconds("wire") == pytest.approx(1.5)


def test_md_full_of_transfers_in_flight_sends_the_request_pd_local():
    """MD's pool holds 2,048 tokens; Reserve takes a request's pages (1,000 + 100) before its
    KV crosses a slow line, so a second request sent meanwhile finds MD full: P -> RLD only."""
    hc = HostConfig(cores=4.0, step_cores=1.0, kv_pages=128)
    cfg = ClusterConfig("pdd", Pool(FLAT, 1), Pool(FLAT, 1), rld=Pool(FLAT, 1), wan_gbps=0.01, wan_latency_s=0.0,
                        wan_jitter_s=0.0, rld_threshold_s=0.0, filter_cap=0.0, user_lag_s=0.0, host=hc)
    trace = [TraceRequest(f"s{i}-t0", i, 0, 0.01 * i, 0.0, i, 0, 1, 0, 1000, 1000, 100, 100) for i in range(2)]
    cl = Cluster(cfg, trace, horizon=float("inf"))
    done = {r.rid: r for r in cl.run()}
    cl.check_integrity()
    assert done["s0-t0"].pipeline in ("P-RLD-MD", "P-RLD*")
    assert done["s1-t0"].pipeline == "P-RLD"
    assert cl.router.reasons.get("main-full") == 1
    assert cl.D[0].committed == 0  # every reservation was handed to MD's pool accounting


def test_p_keeps_a_prompt_leased_until_its_pushes_are_acknowledged():
    """A leased cache entry serves lookups but is not evicted; reservations cannot take its
    tokens; after `unlease` it is an ordinary LRU entry again."""
    c = PrefixCache(100)
    c.insert(("s", 1), 60, 0)
    c.lease(("s", 1))
    c.insert(("s", 2), 30, 0)
    assert not c.can_reserve(50)  # 60 leased + 50 > 100
    assert c.reserve(40)  # evicts session 2 (30 tokens), not the leased session 1
    assert c.get(("s", 1)).tokens == 60 and c.get(("s", 2)) is None
    c.release(40)
    c.unlease(("s", 1))
    assert c.reserve(50) and c.get(("s", 1)) is None  # now evictable
    c.check_integrity()
    with pytest.raises(SimError):
        c.unlease(("s", 1))


def test_prefill_lease_ends_when_the_last_push_lands():
    """pd-cross over a slow line: P's entry for the prompt stays leased until MD has the KV."""
    hc = HostConfig(cores=4.0, step_cores=1.0)
    cfg = ClusterConfig("pd-cross", Pool(FLAT, 1), Pool(FLAT, 1), wan_gbps=0.0005, wan_latency_s=0.0,
                        wan_jitter_s=0.0, user_lag_s=0.0, host=hc)
    trace = [TraceRequest("s0-t0", 0, 0, 0.0, 0.0, 0, 0, 1, 0, 100, 100, 4, 4)]  # 100 KB: 1.6 s on the line
    cl = Cluster(cfg, trace, horizon=float("inf"))
    p, seen = cl.P[0], []
    cl.loop.at(0.5, lambda: seen.append(set(p.leases)))  # prefill done (~0.1 s), KV on the line
    cl.run()
    assert seen == [{"s0-t0"}] and p.leases == set()
    assert p.cache.leased() == 0


@pytest.mark.parametrize("key", [(1, 1, 64, 1), (4, 4, 128, 1), (16, 2, 128, 8), (128, 8, 8, 64), (256, 2, 64, 256),
                                 (256, 4, 128, 128), (32, 4, 128, 16), (8, 2, 8, 4)])
def test_step_table_rows_have_exactly_the_shape_measured(key):
    from pddjax.sim.engine_steps import table_width
    from pddjax.sizes import pow2_at_least as pow2
    from tools.hostlab.step_table import rows_for

    rows = rows_for(key)
    tokens = min(256, sum(n for _, n in rows))  # the engine's step budget
    width = table_width(max(e for e, _ in rows), 16)
    assert (pow2(tokens), pow2(len(rows)), width, pow2(max(n for _, n in rows))) == key


def test_step_model_uses_measured_shapes_and_scales_the_formula_elsewhere():
    prof = {"decode_ms": {"1": 40, "8": 120}, "extend_ms": {"1": 45, "16": 70, "64": 180},
            "prefill_tokens_per_s": 500, "context": 256, "page_size": 16}
    plain = StepModel(MeasuredInstance.from_json(prof))
    f64 = plain.step_s(chunks=[(64, 256 + 64)])  # shape (64, 1, 24, 64)
    table = StepModel(MeasuredInstance.from_json({**prof, "step_table": [[64, 1, 24, 64, 1e3 * 2 * f64]]}))
    assert table.step_s(chunks=[(60, 256 + 64)]) == pytest.approx(2 * f64)  # same bucketed shape: measured
    assert table.step_s(decode_rows=8, decode_kv=272) == pytest.approx(2 * plain.step_s(decode_rows=8, decode_kv=272))
    with pytest.raises(ValueError, match="step_table"):
        MeasuredInstance.from_json({**prof, "step_table": [[64, 1, 24]]})


PINNED = (("main", (1,)), ("prefill", (0,)), ("relay", (1,)))


def test_pinned_services_get_their_own_cores_and_share_within_a_set():
    """bench serve pins P alone on core 0, RLD and MD on core 1: P's prefill runs as fast as
    on an idle core while the decoders step; RLD and MD split core 1 between them."""
    hc = HostConfig(cores=2.0, step_cores=2.0, decode_cores=2.0, cpus=PINNED)
    cfg = ClusterConfig("pdd", Pool(FLAT, 1), Pool(FLAT, 1), rld=Pool(FLAT, 1), user_lag_s=0.0, host=hc)
    cl = Cluster(cfg, trace_one_session(), horizon=float("inf"))
    p_host, md_host, rld_host = cl.P[0].host, cl.D[0].host, cl.R[0].host
    assert md_host is rld_host and p_host is not md_host
    assert (p_host.cores, md_host.cores) == (1.0, 1.0)
    md_host.run(1.0, 2.0, lambda: None)  # a decode step asking for two cores gets the one it has
    assert p_host.slowdown(1.0) == 1.0 and md_host.slowdown(1.0) == 2.0
    local = Cluster(ClusterConfig("pd-local", Pool(FLAT, 1), Pool(FLAT, 1), user_lag_s=0.0, host=hc),
                    trace_one_session(), horizon=float("inf"))
    assert local.D[0].host is local.host_for("relay")  # pd-local decodes on RLD's service
    with pytest.raises(ValueError, match="overlap"):
        Cluster(ClusterConfig("pd-cross", Pool(FLAT, 1), Pool(FLAT, 1), user_lag_s=0.0,
                              host=HostConfig(cpus=(("prefill", (0, 1)), ("main", (1,))))),
                trace_one_session(), horizon=float("inf"))


def test_validation_reads_the_benchmarks_pinning():
    from tools.hostlab.validate import cpus_of

    assert cpus_of({"cpus": {"prefill": [0], "relay": [1], "main": [1]}}) == PINNED
    assert cpus_of({"cpus": None}) == () and cpus_of({}) == ()


def test_host_accounts_cpu_seconds_per_owner():
    """Two one-core jobs on one core: each runs at half speed and is charged its own work."""
    loop = EventLoop()
    h = Host(loop, 1.0)
    h.run(1.0, 1.0, lambda: None, "a")
    h.run(2.0, 1.0, lambda: None, "b")
    loop.run()
    assert loop.now == pytest.approx(3.0)
    assert h.usage() == pytest.approx({"a": 1.0, "b": 2.0})


def test_core_sets_of_one_machine_slow_each_other_by_the_measured_factor():
    """Core 1 decodes a 1 s step from t=0; core 0 starts a 1 s small prefill step at 0.5 and
    a classless 0.1 s job (P's asyncio work) at 0.6. Together the decode step runs 1.5x
    slower, the prefill 1.1x (and at half its core while the classless job shares it, which
    slows nobody on core 1): decode has 0.5 s of work left at 0.5, done at 2/3 speed by 1.25;
    the classless job ends at 0.6 + 0.1 / (0.5 / 1.1) = 0.82; the prefill has done
    0.1/1.1 + 0.1 + 0.43/1.1 by 1.25 and finishes the rest alone. A job slowed by the memory
    system keeps its core busy longer: its CPU seconds are its wall time on the core."""
    from pddjax.sim.host import couple

    loop, done = EventLoop(), {}
    a, b = Host(loop, 1.0), Host(loop, 1.0)
    couple([a, b], {"decode|small": 1.5, "small|decode": 1.1})
    b.run(1.0, 1.0, lambda: done.setdefault("decode", loop.now), "d0", kind="decode")
    loop.at(0.5, lambda: a.run(1.0, 1.0, lambda: done.setdefault("small", loop.now), "p0", kind="small"))
    loop.at(0.6, lambda: a.run(0.1, 1.0, lambda: done.setdefault("loop", loop.now), "p0-loop"))
    loop.run()
    for h in (a, b):
        h.check_integrity()
    small_done_at_125 = 0.1 / 1.1 + 0.1 + 0.43 / 1.1
    assert done["loop"] == pytest.approx(0.82)
    assert done["decode"] == pytest.approx(1.25)
    assert done["small"] == pytest.approx(1.25 + 1.0 - small_done_at_125)
    assert b.usage() == pytest.approx({"d0": 1.25})
    assert a.usage() == pytest.approx({"p0": 0.1 + 0.11 + done["small"] - 0.82, "p0-loop": 0.11})
    assert a.peers == [b] and b.peers == [a] and a.interference() == 1.0  # idle again


def test_cluster_couples_pinned_core_sets_only_when_calibrated():
    from pddjax.sim.host import step_class

    assert [step_class(2, 2, True), step_class(4, 4, True), step_class(64, 2, False), step_class(65, 1, False)] == [
        "decode", "decode4", "small", "large"]
    cross = (("decode|large", 1.6), ("decode|small", 1.3))
    hc = HostConfig(cores=2.0, step_cores=1.0, decode_cores=1.0, cpus=PINNED, cross_slowdown=cross)
    cl = Cluster(ClusterConfig("pdd", Pool(FLAT, 1), Pool(FLAT, 1), rld=Pool(FLAT, 1), user_lag_s=0.0, host=hc),
                 trace_one_session(), horizon=float("inf"))
    p_host, d_host = cl.P[0].host, cl.D[0].host
    assert p_host.peers == [d_host] and d_host.cross == dict(cross)
    plain = Cluster(ClusterConfig("pdd", Pool(FLAT, 1), Pool(FLAT, 1), rld=Pool(FLAT, 1), user_lag_s=0.0,
                                  host=HostConfig(cpus=PINNED)), trace_one_session(), horizon=float("inf"))
    assert plain.P[0].host.peers == []


def test_calibration_cross_slowdown_and_first_use_are_checked(tmp_path):
    from tools.hostlab import calibrate

    good = tmp_path / "good.json"
    good.write_text('{"cross_slowdown": {"decode|small": 1.3}, "first_use_ms": 120}')
    cal = calibrate.load(str(good))
    assert calibrate.host_config(cal).cross_slowdown == (("decode|small", 1.3),)
    engine = {"decode_ms": {"1": 100}, "extend_ms": {"1": 100}, "prefill_tokens_per_s": 5120}
    assert calibrate.profile(engine, cal).first_use_s == pytest.approx(0.12)
    bad = tmp_path / "bad.json"
    bad.write_text('{"cross_slowdown": {"decode|small": -1}}')
    with pytest.raises(ValueError, match="cross_slowdown"):
        calibrate.load(str(bad))


def test_a_shapes_first_step_costs_its_first_use_once_per_engine():
    """pddjax lowers a new step shape and loads its executable on first use (`first_use_ms`,
    measured by `step_table --first-use`); every engine pays it once per shape."""
    prof = {"decode_ms": {"1": 100}, "extend_ms": {"1": 100}, "prefill_tokens_per_s": 5120,
            "kv_bytes_per_token": 1000, "first_use_ms": 50}
    perf = MeasuredInstance.from_json(prof)
    one, other = StepModel(perf), StepModel(perf)
    first, again = one.step_s(decode_rows=1, decode_kv=100), one.step_s(decode_rows=1, decode_kv=100)
    assert first - again == pytest.approx(0.05)
    assert one.step_s(decode_rows=2, decode_kv=100) > one.step_s(decode_rows=2, decode_kv=100)  # a new shape
    assert other.step_s(decode_rows=1, decode_kv=100) == pytest.approx(first)  # another engine: its own first use
    fresh = StepModel(perf)
    times = [fresh.step_s(decode_rows=b, decode_kv=100) for b in (1, 1, 2)]
    assert fresh.seconds == pytest.approx(sum(times)) and sum(fresh.shapes.values()) == 3
    with pytest.raises(ValueError, match="first_use_ms"):
        MeasuredInstance.from_json({**prof, "first_use_ms": -1})
