"""What the router has measured, for the auto policy (`choose`) and for `Stats`.

  - one `LinkEstimator` per MD address: the A -> B link's throughput and latency, plus the
    bytes queued on it now (booked when a push starts, settled when P reports it or the
    request is released). It starts from the configured capacity (`[router] wan_mbps`, which
    also caps it) or else the prior (`wan_mbps_prior`), is seeded by a probe of the link and
    refreshed by every completed KV transfer (P's TransferDone, background syncs too);
  - one `Ewma` per RLD address: the decode speed of one request (tokens/s after its first
    batch), learnt when a request that streamed from RLD finishes (prior until then);
  - the KV wire format per target (`wire_format`: `[wan] kv_wire` for MD, `[router]
    relay_kv_wire` for RLD, if the target declared it in its Info, else native) and what one
    prompt token weighs in it (`wire_bytes_per_token`: P's canonical bytes x the format's ratio,
    nominal (pddjax.kv.codec, scales included) until transfers in it measured it (`learn_wire`:
    zstd's ratio depends on the KV), so transfer estimates, `explain` and the link's bookings
    count the bytes that cross.

The probe (`probe`, in the background at the router's start, when an MD rejoins the rotation,
and when an auto request is planned on a link nothing has measured yet: `probe_unmeasured`)
measures the link over the path P's KV takes (MD's `main_wan` address, else `main`)
with MD's `Probe` RPC: one empty call to open the connection, PROBE_RTTS empty calls (the
median is the round trip), then up to PROBE_ROUNDS payload rounds: the first of
policy.PROBE_FIRST_BYTES (32 KiB), each next one sized to take ~0.25 s at the rate measured so
far (policy.probe_size, at most 2 MiB). So a 1 Mb/s line costs ~1 s and ~100 KiB, a 20 Mb/s
one ~0.8 s and ~1.3 MiB, and a fast one 2 MiB rounds (~0.2 s at 100 Mb/s); the rate is the
largest round's. The whole probe stops after PROBE_BUDGET_S: a round cut off by it still says
the line is slower than its bytes over the time it waited, which bounds the estimate
(conservative: a too-low estimate sends a request pdd, where RLD masks the
transfer; a too-high one sends it pd-cross to wait for it). Each round seeds the estimator as
it lands. A request planned while its MD's first probe runs waits for it up to
`wan_probe_wait_ms` (`settled`), then uses what has been measured so far.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TYPE_CHECKING

import grpc

from pddjax import policy
from pddjax.kv import codec
from pddjax.policy import Ewma, LinkEstimator
from serving.pb import cluster_pb2
from serving.router import pools
from serving.router.give_up import SwitchClock

if TYPE_CHECKING:
    from serving.config import RouterSettings
    from serving.router.pools import Instance

PROBE_RTTS = 3  # empty round trips (after the one that opens the connection)
PROBE_ROUNDS = 3  # payload rounds at most
PROBE_BUDGET_S = 3.0  # the whole probe, connection included
PROBE_MIN_INTERVAL_S = 10.0  # an MD flapping in and out of the rotation is probed at most this often


class Estimates:
    def __init__(self, settings: RouterSettings):
        self.capacity_mbps = float(settings.wan_mbps)
        self.wan_mbps_prior = self.capacity_mbps or settings.wan_mbps_prior
        self.wan_latency_s_prior = settings.wan_latency_ms_prior / 1e3
        self.relay_tokens_per_s_prior = settings.rld_tokens_per_s_prior
        self.switch_prior_s = settings.handoff_switch_prior_s
        self.links: dict[str, LinkEstimator] = {}  # by MD address
        self.relay_speed: dict[str, Ewma] = {}  # by RLD address, tokens/s of one request
        self.switch_clocks: dict[str, SwitchClock] = {}  # by MD address: handoff start -> switch (give_up.py)
        self.probes: dict[str, asyncio.Task] = {}  # by MD address: the probe running or last run
        self.probed: dict[str, dict] = {}  # by MD address: what the last probe measured (Stats)
        self.measured: set[str] = set()  # MD addresses whose first probe has ended (either way)
        self.probe_started: dict[str, float] = {}  # by MD address: time.monotonic() of the last probe's start
        self.kv_wire = {"main": settings.kv_wire, "relay": settings.relay_kv_wire}  # configured, by target role
        self.wire_ratio: dict[str, Ewma] = {}  # by format: encoded / canonical bytes of completed transfers
        self.undeclared: set[tuple[str, str]] = set()  # (address, format) refused by a target's Info: logged once

    def link(self, main: Instance) -> LinkEstimator:
        if main.address not in self.links:
            self.links[main.address] = LinkEstimator(self.wan_mbps_prior, self.wan_latency_s_prior,
                                                     cap_mbps=self.capacity_mbps,
                                                     source="configured" if self.capacity_mbps else "prior")
        return self.links[main.address]

    def speed(self, relay: Instance) -> Ewma:
        speed = self.relay_speed.get(relay.address)  # read per RLD batch while a handoff runs: no Ewma built
        if speed is None:
            speed = self.relay_speed[relay.address] = Ewma(self.relay_tokens_per_s_prior)
        return speed

    def switch_clock(self, main: Instance) -> SwitchClock:
        clock = self.switch_clocks.get(main.address)
        if clock is None:
            clock = self.switch_clocks[main.address] = SwitchClock(self.switch_prior_s)
        return clock

    # ---- the KV wire format per target ---------------------------------------------------
    async def wire_format(self, target: Instance) -> str:
        """The configured KV wire format for `target`'s role if the target declared it (its
        Info's kv_wire_formats), else native (logged once per target and format)."""
        want = self.kv_wire.get(target.role, "native")
        try:
            if want == "native" or want in (await pools.info(target)).kv_wire_formats:
                return want
        except grpc.aio.AioRpcError:
            return "native"  # no Info now: the format every receiver decodes
        if (target.address, want) not in self.undeclared:
            self.undeclared.add((target.address, want))
            print(f"router: {target.role} {target.address} does not accept KV as {want}; it gets native",
                  file=sys.stderr, flush=True)
        return "native"

    def ratio(self, fmt: str, info: cluster_pb2.ServiceInfo) -> Ewma:
        """Encoded / canonical bytes of `fmt` for KV shaped like `info`'s (P's): nominal first."""
        if fmt not in self.wire_ratio:
            args = (info.num_layers, info.num_kv_heads, info.head_dim, info.dtype or "float32", info.page_size or 16)
            self.wire_ratio[fmt] = Ewma(codec.bytes_per_token(fmt, *args) / codec.bytes_per_token("native", *args))
        return self.wire_ratio[fmt]

    async def wire_bytes_per_token(self, prefill: Instance, fmt: str) -> float:
        """What one prompt token's KV weighs on the wire from `prefill` in `fmt`."""
        native = await pools.kv_bytes_per_token(prefill)
        return native if fmt == "native" else native * self.ratio(fmt, await pools.info(prefill)).value

    def learn_wire(self, fmt: str, d: cluster_pb2.TransferDone) -> None:
        """A completed transfer in `fmt` refines the format's ratio (zstd's depends on the KV)."""
        if fmt in self.wire_ratio and not d.code and d.native_bytes >= 64 * 1024:
            self.wire_ratio[fmt].add(d.bytes / d.native_bytes)

    # ---- the link probe ----------------------------------------------------------------
    def start_probe(self, main: Instance) -> bool:
        """Probes `main`'s link in the background (-> True), unless a probe of it runs or
        started less than PROBE_MIN_INTERVAL_S ago."""
        task, now = self.probes.get(main.address), time.monotonic()
        if task is None or (task.done() and now - self.probe_started.get(main.address, 0.0) >= PROBE_MIN_INTERVAL_S):
            self.probe_started[main.address] = now
            self.probes[main.address] = asyncio.get_running_loop().create_task(self.probe(main))
            return True
        return False

    def probe_unmeasured(self, main: Instance) -> bool:
        """A request is being planned on `main`'s link while nothing has measured it (its probe
        failed, e.g. while MD was still compiling, and no transfer has finished): probe it again
        in the background (-> True), at most every PROBE_MIN_INTERVAL_S (`start_probe`)."""
        return self.link(main).source == "prior" and self.start_probe(main)

    async def settled(self, main: Instance, timeout_s: float) -> None:
        """Waits, at most `timeout_s`, for the first probe of `main` while it runs (later ones,
        on a rejoin, find an estimate already there); never cancels the probe."""
        task = self.probes.get(main.address)
        if task is not None and not task.done() and main.address not in self.measured:
            await asyncio.wait([task], timeout=max(timeout_s, 0.0))

    async def probe(self, main: Instance) -> dict:
        """Measures the link to `main` and seeds its estimator; -> what was measured (also in
        Stats). A failure (MD gone, link down) leaves the estimate as it was."""
        link, stub, t_start = self.link(main), pools.kv_stub(main), time.perf_counter()
        out: dict = {"via": main.kv_address, "rtt_ms": None, "rounds": [], "mbps": None, "error": ""}
        self.probed[main.address] = out

        def left() -> float:
            return PROBE_BUDGET_S - (time.perf_counter() - t_start)

        async def call(nbytes: int) -> float:
            t0 = time.perf_counter()
            await stub.Probe(cluster_pb2.ProbeRequest(payload=bytes(nbytes)), timeout=max(left(), 0.01))
            return time.perf_counter() - t0

        try:
            await call(0)  # opens the connection (TCP and HTTP/2 handshakes over the link)
            rtt = policy.probe_rtt([await call(0) for _ in range(PROBE_RTTS)])
            out["rtt_ms"] = 1e3 * rtt
            nbytes, rounds = policy.PROBE_FIRST_BYTES, []
            for _ in range(PROBE_ROUNDS):
                if left() <= rtt:
                    break
                t0 = time.perf_counter()
                try:
                    rounds.append((nbytes, await call(nbytes)))
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise
                    bound = policy.probe_rate(nbytes, time.perf_counter() - t0, 0.0)  # the line is slower
                    rate = min(bound, policy.probe_estimate(rounds, rtt)) if rounds else bound
                    link.seed(rate, rtt)
                    out["mbps"] = 8 * rate / 1e6
                    out["error"] = f"a {nbytes} B round did not finish within the {PROBE_BUDGET_S:.0f} s budget"
                    break
                out["rounds"].append({"bytes": nbytes, "ms": 1e3 * rounds[-1][1]})
                rate = policy.probe_estimate(rounds, rtt)
                link.seed(rate, rtt)
                out["mbps"] = 8 * rate / 1e6
                nbytes = policy.probe_size(rate)
        except grpc.aio.AioRpcError as e:
            out["error"] = f"{e.code().name}: {e.details()}"
        except Exception as e:  # noqa: BLE001  (a background task: report it, never leave it unretrieved)
            out["error"] = repr(e)
        out["s"] = time.perf_counter() - t_start
        self.measured.add(main.address)
        mbps = "-" if out["mbps"] is None else f"{out['mbps']:.1f}"
        rtt_ms = "-" if out["rtt_ms"] is None else f"{out['rtt_ms']:.0f}"
        print(f"router: probed the link to MD {main.address} via {main.kv_address}: {mbps} Mb/s, RTT {rtt_ms} ms "
              f"in {out['s']:.2f} s{'; ' + out['error'] if out['error'] else ''} -> estimate "
              f"{8 * link.throughput.value / 1e6:.1f} Mb/s ({link.describe()})", file=sys.stderr, flush=True)
        return out

    def stats(self) -> dict:
        now = time.monotonic()
        return {"links": {a: {"mbps": 8 * lk.throughput.value / 1e6, "latency_ms": 1e3 * lk.latency.value,
                              "queued_bytes": lk.queued, "samples": lk.throughput.samples,
                              "source": lk.source, "age_s": now - lk.at, "describe": lk.describe(now),
                              "probe": self.probed.get(a)}
                          for a, lk in self.links.items()},
                "rld_tokens_per_s": {a: e.value for a, e in self.relay_speed.items()},
                "handoff_switch": {a: c.stats() for a, c in self.switch_clocks.items()},
                "kv_wire": {**self.kv_wire, "ratios": {f: {"ratio": e.value, "samples": e.samples}
                                                       for f, e in self.wire_ratio.items()}}}
