"""The router's Prometheus metrics (on the service's registry, next to the per-RPC ones of
`metrics.ServiceMetrics`, served on the same /metrics endpoint):

  pddjax_router_ttft_seconds{pipeline}          histogram: request received -> first token sent
  pddjax_router_itl_seconds{pipeline}           histogram: gap between consecutive tokens (a
                                                message of k tokens counts k gaps of dt/k)
  pddjax_router_inflight                        gauge: requests holding an admission slot
  pddjax_router_queue_depth                     gauge: requests waiting for a slot
  pddjax_router_pipeline_total{pipeline,reason} pipelines chosen (the final one: a fallback
                                                counts as its own reason, e.g. main-full)
  pddjax_router_handoffs_total{mode}            RLD -> MD handoffs done (one-shot | chunked)
  pddjax_router_main_given_up_total{when}       pdd requests whose MD was given up (skipped: no
                                                handoff; stopped: the running one cancelled)
  pddjax_router_failures_total{code,stage}      failed requests by gRPC code and stage
                                                (admission, plan, reserve, prefill, relay, main, stream)
  pddjax_router_wan_bytes_total                 KV bytes A -> B (P's transfer_done to MD, background syncs too)
  pddjax_router_requests_completed_total{pipeline}
  pddjax_router_handoff_gap_seconds             histogram: at RLD -> MD switches, the gap between the
                                                last token sent from RLD and the first from MD
  pddjax_router_link_mbps{main}                 gauge: the link estimate to each MD (address), Mb/s
  pddjax_router_link_latency_seconds{main}      gauge: its one-way latency estimate (estimates.py)

The router calls these hooks only; nothing here touches a request's state. The metrics live on
their own registry until `attach` adds them to the service's (one object for the router's life).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from serving.metrics import LATENCY_BUCKETS

ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, admission=None):
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self._per_pipeline: dict[str, tuple] = {}  # pipeline -> its (TTFT, ITL) children
        self.ttft = Histogram("pddjax_router_ttft_seconds", "request received -> first token sent", ["pipeline"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pddjax_router_itl_seconds", "gap between consecutive tokens sent", ["pipeline"],
                             buckets=ITL_BUCKETS, registry=r)
        self.inflight = Gauge("pddjax_router_inflight", "requests holding an admission slot", registry=r)
        self.queue_depth = Gauge("pddjax_router_queue_depth", "requests waiting for an admission slot", registry=r)
        self.pipelines = Counter("pddjax_router_pipeline", "pipelines chosen, by pipeline and reason",
                                 ["pipeline", "reason"], registry=r)
        self.handoffs = Counter("pddjax_router_handoffs", "RLD -> MD handoffs done, by mode", ["mode"], registry=r)
        self.given_up = Counter("pddjax_router_main_given_up", "pdd requests whose MD was given up (they end on "
                                "RLD before the switch), by when", ["when"], registry=r)
        self.failures = Counter("pddjax_router_failures", "failed requests, by gRPC code and stage", ["code", "stage"],
                                registry=r)
        self.wan = Counter("pddjax_router_wan_bytes", "KV bytes sent A -> B (P's transfers to MD)", registry=r)
        self.completed = Counter("pddjax_router_requests_completed", "requests finished, by pipeline", ["pipeline"],
                                 registry=r)
        self.queued = Histogram("pddjax_router_page_wait_seconds", "time a request waited for KV pages on a tier "
                                "(P's, RLD's or MD's page queue; part of its TTFT)", ["tier"],
                                buckets=LATENCY_BUCKETS, registry=r)
        self.handoff_gap = Histogram("pddjax_router_handoff_gap_seconds", "RLD -> MD switch: last RLD token sent -> "
                                     "first MD token sent", buckets=ITL_BUCKETS, registry=r)
        self.links = LinkCollector()
        r.register(self.links)
        if admission is not None:  # read at scrape time
            self.inflight.set_function(lambda: admission.inflight)
            self.queue_depth.set_function(lambda: admission.queued)

    def attach(self, registry: CollectorRegistry) -> None:
        """The same collectors join `registry` too (the service's, served on its /metrics)."""
        for c in (self.ttft, self.itl, self.inflight, self.queue_depth, self.pipelines, self.handoffs, self.given_up,
                  self.failures, self.wan, self.completed, self.queued, self.handoff_gap, self.links):
            registry.register(c)
        self.registry = registry

    # ---- hooks ---------------------------------------------------------------------------
    def chosen(self, pipeline: str, reason: str) -> None:
        self.pipelines.labels(pipeline, reason).inc()

    def handoff(self, chunks: int) -> None:
        self.handoffs.labels("chunked" if chunks > 1 else "one-shot").inc()

    def gave_up(self, when: str) -> None:
        self.given_up.labels(when).inc()

    def failed(self, code_name: str, stage: str) -> None:
        self.failures.labels(code_name, stage or "unknown").inc()

    def wan_bytes(self, n: int) -> None:
        if n > 0:
            self.wan.inc(n)

    def page_wait(self, tier: str, ms: float) -> None:
        """A tier answered after its page queue held the request `ms` (0: it fitted at once)."""
        self.queued.labels(tier).observe(ms / 1e3)

    def done(self, pipeline: str) -> None:
        self.completed.labels(pipeline).inc()

    def per_pipeline(self, pipeline: str) -> tuple:
        """(TTFT, ITL) histograms of `pipeline`, labelled once (not per batch: `labels()` takes a
        lock and hashes the label values)."""
        got = self._per_pipeline.get(pipeline)
        if got is None:
            got = self._per_pipeline[pipeline] = (self.ttft.labels(pipeline), self.itl.labels(pipeline))
        return got

    def timer(self, t0: float) -> TokenTimer:
        return TokenTimer(self, t0)

    def watch_links(self, estimates) -> None:
        """Export `estimates`' link estimate per MD (read at scrape time)."""
        self.links.estimates = estimates


class LinkCollector:
    """pddjax_router_link_mbps / _latency_seconds per MD, read from `Estimates.links` at scrape time."""

    def __init__(self):
        self.estimates = None

    def describe(self):
        return []

    def collect(self):
        mbps = GaugeMetricFamily("pddjax_router_link_mbps", "link estimate to each MD, Mb/s", labels=["main"])
        latency = GaugeMetricFamily("pddjax_router_link_latency_seconds", "one-way latency estimate to each MD",
                                    labels=["main"])
        for address, lk in dict(getattr(self.estimates, "links", {})).items():
            mbps.add_metric([address], 8 * lk.throughput.value / 1e6)
            latency.add_metric([address], lk.latency.value)
        yield mbps
        yield latency


class TokenTimer:
    """One request's token times: its first batch -> TTFT, every later one -> ITL."""

    def __init__(self, m: RouterMetrics, t0: float):
        self.m, self.t0, self.last = m, t0, None  # perf_counter times
        self.switched = False  # the stream moved RLD -> MD: the next batch's gap is the handoff gap

    def switch(self) -> None:
        self.switched = True

    def tokens(self, pipeline: str, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        now = time.perf_counter() if now is None else now
        ttft, h = self.m.per_pipeline(pipeline)
        if self.last is None:
            ttft.observe(now - self.t0)
            n -= 1  # the other tokens of the first batch came with it
            gap = 0.0
        else:
            gap = (now - self.last) / n
            if self.switched:
                self.m.handoff_gap.observe(now - self.last)
                self.switched = False
        for _ in range(n):
            h.observe(gap)
        self.last = now
