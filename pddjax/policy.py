"""The router's decisions, as plain Python (no gRPC, no JAX): which pipeline a request takes,
how RLD hands off, and the running estimates they rest on.

`decide(Inputs, PolicyConfig) -> Decision`, in order:
  1. delta = prompt tokens MD's DRC lacks; delta bytes = delta * KV bytes per token;
     transfer time = link latency + (bytes queued on the link + delta bytes) / measured throughput.
  2. transfer time <= TTFT budget -> **pd-cross** (P-MD: the delta reaches MD in time, RLD unused).
  3. otherwise the whole output (max tokens, or the session's predicted output when shorter)
     at RLD's speed: RLD would finish it before MD holds the KV -> singular traffic, unless
       - the filtered share of recent decisions has reached the cap (-> pdd, "cap"), or
       - the session's MD hit lags its P hit by more than the drift tolerance (-> pdd, "drift"):
     singular -> **pd-local**, the WAN transfer cancelled; a request with a session id still gets
     its context to MD afterwards (`sync_main`: a low-priority background push), so the
     session's later turns hit MD (the drift-loop guard).
  4. else **pdd** (P-RLD-MD: RLD masks the transfer).

Handoff: RLD hands off one-shot when at most `threshold` tokens are pending, else in chunks
(`handoff_mode`); the router predicts the pending count for the explanation.

The link estimate (`LinkEstimator`) starts from a prior (`[router] wan_mbps_prior`, or the
configured capacity `wan_mbps`, which also caps it), is seeded by the router's probe
(`probe_rate` / `probe_size`: a few empty round trips, then payload rounds sized from the
previous round) and refreshed by every completed transfer; it knows its source and age.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time

PD_CROSS, PDD, PD_LOCAL = "pd-cross", "pdd", "pd-local"


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    ttft_budget_s: float = 0.5  # extra TTFT a request may wait for its KV to reach MD
    filter_cap: float = 0.05  # at most this share of recent decisions is filtered (pd-local)
    filter_window: int = 200  # decisions the share is measured over
    drift_tolerance: float = 0.2  # session MD hit may lag its P hit by this fraction of the prompt
    # The final handoff chunk carries at most this many tokens: above it RLD sends catch-up chunks
    # while it decodes on (MD extends them, then decodes ahead, held), so the switch waits for a
    # short tail only. Measured (tools/handoff_gap.py; docs/figures.md, "Handoff"): 4 halves the gap of 64.
    handoff_threshold: int = 4


@dataclasses.dataclass(frozen=True)
class Inputs:
    prompt_tokens: int
    max_tokens: int
    hit_prefill: int  # prompt tokens P's prefix cache holds
    hit_main: int  # prompt tokens MD's DRC holds
    kv_bytes_per_token: int
    wan_bytes_per_s: float  # measured A -> B throughput
    wan_latency_s: float
    wan_queue_bytes: int  # bytes already queued on the link to this MD
    relay_tokens_per_s: float  # RLD's measured decode speed for one request
    filtered_share: float = 0.0  # of the last filter_window decisions
    session_id: str = ""
    predicted_output: int | None = None  # from the session's earlier turns
    session_drift: float = 0.0  # mean (P hit - MD hit) / prompt over the session's turns
    wan_source: str = ""  # where the link estimate comes from (LinkEstimator.describe): explain only


@dataclasses.dataclass(frozen=True)
class Decision:
    pipeline: str  # pd-cross | pdd | pd-local
    reason: str  # fast-delta | mask | singular | cap | drift
    delta_tokens: int
    delta_bytes: int
    transfer_s: float
    output_tokens: int  # the output estimate used
    relay_finish_s: float  # RLD alone would finish the output in this time
    sync_main: bool = False  # pd-local: push the session's context to MD in the background
    handoff_pending: int = 0  # pdd: tokens RLD is predicted to hold at handoff
    handoff: str = ""  # pdd: the handoff that predicts (RLD decides on the real count)

    def explain(self, i: Inputs) -> str:
        s = (f"{self.pipeline} ({self.reason}): hit P {i.hit_prefill}/{i.prompt_tokens}, "
             f"MD {i.hit_main}/{i.prompt_tokens}; delta {self.delta_tokens} tok = {self.delta_bytes} B; "
             f"est. transfer {1e3 * self.transfer_s:.0f} ms at {8 * i.wan_bytes_per_s / 1e6:.1f} Mb/s "
             f"+ {1e3 * i.wan_latency_s:.0f} ms ({i.wan_source + '; ' if i.wan_source else ''}"
             f"+{i.wan_queue_bytes} B queued); RLD {self.output_tokens} tok in {1e3 * self.relay_finish_s:.0f} ms")
        if self.pipeline == PDD:
            s += f"; ~{self.handoff_pending} tok pending at handoff ({self.handoff})"
        if self.pipeline == PD_LOCAL:
            s += "; WAN transfer cancelled" + (", context synced to MD in the background" if self.sync_main else "")
        return s


def transfer_time(delta_bytes: int, i: Inputs) -> float:
    if delta_bytes == 0:
        return 0.0
    return i.wan_latency_s + (i.wan_queue_bytes + delta_bytes) / max(i.wan_bytes_per_s, 1.0)


def decide(i: Inputs, c: PolicyConfig) -> Decision:
    delta = max(i.prompt_tokens - i.hit_main, 0)
    delta_bytes = delta * i.kv_bytes_per_token
    t = transfer_time(delta_bytes, i)
    out = i.max_tokens if i.predicted_output is None else max(1, min(i.max_tokens, i.predicted_output))
    relay_s = out / max(i.relay_tokens_per_s, 1e-6)
    d = dict(delta_tokens=delta, delta_bytes=delta_bytes, transfer_s=t, output_tokens=out, relay_finish_s=relay_s)
    if t <= c.ttft_budget_s:
        return Decision(PD_CROSS, "fast-delta", **d)
    pending = min(i.max_tokens, int(t * i.relay_tokens_per_s))
    d_pdd = dict(handoff_pending=pending, handoff=handoff_mode(pending, c.handoff_threshold), **d)
    if relay_s < t:
        if i.filtered_share >= c.filter_cap:
            return Decision(PDD, "cap", **d_pdd)
        if i.session_drift > c.drift_tolerance:
            return Decision(PDD, "drift", **d_pdd)
        return Decision(PD_LOCAL, "singular", sync_main=bool(i.session_id), **d)
    return Decision(PDD, "mask", **d_pdd)


def handoff_mode(pending: int, threshold: int) -> str:
    """RLD's rule at handoff time: chunks while more than `threshold` tokens are pending."""
    return "chunked" if pending > threshold else "one-shot"


class Ewma:
    """A running estimate: the prior until the first sample, then an exponential average."""

    def __init__(self, prior: float, alpha: float = 0.3):
        self.value, self.alpha, self.samples = prior, alpha, 0

    def add(self, x: float) -> None:
        self.value = x if self.samples == 0 else (1 - self.alpha) * self.value + self.alpha * x
        self.samples += 1


class LinkEstimator:
    """Throughput and latency of one A -> B link, plus its queue, with where they come from.

    A transfer of `bytes` that took `seconds` on the wire (P's TransferDone.wire_ms: the push's
    time without the time it waited on P's own prefill, so a slow prefill is not read as a slow
    line) is read as
    latency + bytes / throughput: transfers under `min_bytes` only update the latency,
    larger ones the throughput (after subtracting the latency estimate).
    `seed` replaces both with a probe's measurement (it counts as one sample, so transfers
    average into it). `cap_mbps` > 0 (the configured capacity) bounds the throughput: a
    measurement above the provisioned rate is the measurement's error, not the line's.
    `source` (prior | configured | probe | transfers) and `at` (time.monotonic() of the last
    update) say what the throughput rests on (`describe`)."""

    def __init__(self, prior_mbps: float, prior_latency_s: float, min_bytes: int = 64 * 1024,
                 cap_mbps: float = 0.0, source: str = "prior"):
        self.cap = cap_mbps * 1e6 / 8 if cap_mbps > 0 else 0.0  # bytes/s; 0 = none
        self.throughput = Ewma(self._capped(prior_mbps * 1e6 / 8))  # bytes/s
        self.latency = Ewma(prior_latency_s)
        self.min_bytes = min_bytes
        self.queued = 0  # bytes of transfers started and not yet completed
        self.source, self.at = source, time.monotonic()

    def _capped(self, bytes_per_s: float) -> float:
        return min(bytes_per_s, self.cap) if self.cap else bytes_per_s

    def start(self, nbytes: int) -> None:
        self.queued += nbytes

    def done(self, planned: int, nbytes: int, seconds: float, ok: bool = True,
             total_seconds: float | None = None) -> None:
        """A transfer finished. `total_seconds` (its whole time, P's waits on its own prefill
        included) > 2x `seconds`: the push mostly waited for P, and the bytes already sent kept
        crossing the line meanwhile, so `seconds` under-counts the line's time and the rate it
        implies is an over-read: such a transfer only moves the estimate into [its lower bound
        (bytes / total), the over-read (bytes / seconds)]: raised to the first, or lowered to the
        second (no push of these bytes went faster: an estimate above it, a prior never probed
        say, would send requests pd-cross to wait for a line they overrate), never set from the
        over-read otherwise."""
        self.queued = max(0, self.queued - planned)
        if not ok or seconds <= 0:
            return
        if nbytes < self.min_bytes:
            self.latency.add(seconds)
            return
        if total_seconds is not None and total_seconds > 2 * seconds:
            floor = nbytes / max(total_seconds - self.latency.value, 0.1 * total_seconds)
            ceiling = nbytes / max(seconds - self.latency.value, 0.1 * seconds)
            value = self._capped(min(max(self.throughput.value, floor), ceiling))
            if value != self.throughput.value:
                self.throughput.value = value
                self.source, self.at = "transfers", time.monotonic()
            return
        self.throughput.add(nbytes / max(seconds - self.latency.value, 0.1 * seconds))
        self.throughput.value = self._capped(self.throughput.value)
        self.source, self.at = "transfers", time.monotonic()

    def seed(self, bytes_per_s: float, latency_s: float | None = None, source: str = "probe") -> None:
        """A probe's measurement replaces the estimate (throughput capped); transfers refine it."""
        self.throughput.value = self._capped(bytes_per_s)
        self.throughput.samples = max(self.throughput.samples, 1)
        if latency_s is not None:
            self.latency.value, self.latency.samples = latency_s, max(self.latency.samples, 1)
        self.source, self.at = source, time.monotonic()

    def describe(self, now: float | None = None) -> str:
        """"probe, 3 s ago" | "transfers, 0 s ago" | "prior" | "configured" (+ ", capped")."""
        s = self.source
        if s in ("probe", "transfers"):
            s += f", {max(0.0, (time.monotonic() if now is None else now) - self.at):.0f} s ago"
        if self.cap and self.throughput.value >= self.cap and self.source != "configured":
            s += f", capped at the configured {8 * self.cap / 1e6:g} Mb/s"
        return s


# ---- the router's link probe: its arithmetic (the RPCs are serving/router/estimates.py's) ----
PROBE_FIRST_BYTES = 32 * 1024  # the first payload round: 0.26 s at 1 Mb/s, 13 ms at 20 Mb/s
PROBE_MAX_BYTES = 2 * 1024 * 1024  # one round at most (MD refuses above 4 MiB)
PROBE_ROUND_S = 0.25  # later rounds aim at this long on the wire: well above RTT noise, still short


def probe_rtt(seconds: list[float]) -> float:
    """The round trip from empty probes (the median: one slow answer does not move it)."""
    return statistics.median(seconds) if seconds else 0.0


def probe_rate(nbytes: int, seconds: float, rtt: float) -> float:
    """Bytes/s of one payload round that took `seconds`: the round trip subtracted, as for a
    transfer (LinkEstimator.done), never below a tenth of the round."""
    return nbytes / max(seconds - rtt, 0.1 * seconds, 1e-6)


def probe_size(bytes_per_s: float) -> int:
    """The next round's payload: PROBE_ROUND_S at the rate measured so far, within
    [PROBE_FIRST_BYTES, PROBE_MAX_BYTES], in whole KiB."""
    n = int(bytes_per_s * PROBE_ROUND_S) // 1024 * 1024
    return max(PROBE_FIRST_BYTES, min(PROBE_MAX_BYTES, n))


def probe_estimate(rounds: list[tuple[int, float]], rtt: float) -> float:
    """The link's bytes/s from payload rounds (bytes, seconds): the largest round's rate (ties:
    the later one), which has the most bytes against the RTT's noise and the flow-control
    window's warm-up. 0 when no round finished."""
    if not rounds:
        return 0.0
    n, t = max(reversed(rounds), key=lambda r: r[0])
    return probe_rate(n, t, rtt)


class SessionTracker:
    """Per session: P hit vs MD hit per turn (the drift guard) and output lengths (prediction)."""

    def __init__(self, max_sessions: int = 10_000, turns: int = 4):
        self.sessions: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self.max_sessions, self.turns = max_sessions, turns

    def _get(self, sid: str) -> dict:
        s = self.sessions.pop(sid, None) or {"drift": collections.deque(maxlen=self.turns),
                                             "outputs": collections.deque(maxlen=self.turns)}
        self.sessions[sid] = s  # most recently used last
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
        return s

    def drift(self, sid: str) -> float:
        s = self.sessions.get(sid)
        return sum(s["drift"]) / len(s["drift"]) if s and s["drift"] else 0.0

    def predicted_output(self, sid: str) -> int | None:
        s = self.sessions.get(sid)
        return max(s["outputs"]) if s and s["outputs"] else None

    def record_hits(self, sid: str, prompt_tokens: int, hit_prefill: int, hit_main: int) -> None:
        if sid and prompt_tokens:
            self._get(sid)["drift"].append(max(hit_prefill - hit_main, 0) / prompt_tokens)

    def record_output(self, sid: str, tokens: int) -> None:
        if sid:
            self._get(sid)["outputs"].append(tokens)


class FilterWindow:
    """The filtered share of the last `size` decisions (the singular filter's cap)."""

    def __init__(self, size: int):
        self.window: collections.deque[bool] = collections.deque(maxlen=max(size, 1))

    def share(self) -> float:
        return sum(self.window) / len(self.window) if self.window else 0.0

    def add(self, filtered: bool) -> None:
        self.window.append(filtered)
