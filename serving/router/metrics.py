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
  pddjax_router_failures_total{code,stage}      failed requests by gRPC code and stage
                                                (admission, plan, reserve, prefill, relay, main, stream)
  pddjax_router_wan_bytes_total                 KV bytes A -> B (P's transfer_done to MD, background syncs too)
  pddjax_router_requests_completed_total{pipeline}

The router calls these hooks only; nothing here touches a request's state. The metrics live on
their own registry until `attach` adds them to the service's (one object for the router's life).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from serving.metrics import LATENCY_BUCKETS

ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, admission=None):
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.ttft = Histogram("pddjax_router_ttft_seconds", "request received -> first token sent", ["pipeline"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pddjax_router_itl_seconds", "gap between consecutive tokens sent", ["pipeline"],
                             buckets=ITL_BUCKETS, registry=r)
        self.inflight = Gauge("pddjax_router_inflight", "requests holding an admission slot", registry=r)
        self.queue_depth = Gauge("pddjax_router_queue_depth", "requests waiting for an admission slot", registry=r)
        self.pipelines = Counter("pddjax_router_pipeline", "pipelines chosen, by pipeline and reason",
                                 ["pipeline", "reason"], registry=r)
        self.handoffs = Counter("pddjax_router_handoffs", "RLD -> MD handoffs done, by mode", ["mode"], registry=r)
        self.failures = Counter("pddjax_router_failures", "failed requests, by gRPC code and stage", ["code", "stage"],
                                registry=r)
        self.wan = Counter("pddjax_router_wan_bytes", "KV bytes sent A -> B (P's transfers to MD)", registry=r)
        self.completed = Counter("pddjax_router_requests_completed", "requests finished, by pipeline", ["pipeline"],
                                 registry=r)
        self.queued = Histogram("pddjax_router_page_wait_seconds", "time a request waited for KV pages on a tier "
                                "(P's, RLD's or MD's page queue; part of its TTFT)", ["tier"],
                                buckets=LATENCY_BUCKETS, registry=r)
        if admission is not None:  # read at scrape time
            self.inflight.set_function(lambda: admission.inflight)
            self.queue_depth.set_function(lambda: admission.queued)

    def attach(self, registry: CollectorRegistry) -> None:
        """The same collectors join `registry` too (the service's, served on its /metrics)."""
        for c in (self.ttft, self.itl, self.inflight, self.queue_depth, self.pipelines, self.handoffs, self.failures,
                  self.wan, self.completed, self.queued):
            registry.register(c)
        self.registry = registry

    # ---- hooks ---------------------------------------------------------------------------
    def chosen(self, pipeline: str, reason: str) -> None:
        self.pipelines.labels(pipeline, reason).inc()

    def handoff(self, chunks: int) -> None:
        self.handoffs.labels("chunked" if chunks > 1 else "one-shot").inc()

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

    def timer(self, t0: float) -> TokenTimer:
        return TokenTimer(self, t0)


class TokenTimer:
    """One request's token times: its first batch -> TTFT, every later one -> ITL."""

    def __init__(self, m: RouterMetrics, t0: float):
        self.m, self.t0, self.last = m, t0, None  # perf_counter times

    def tokens(self, pipeline: str, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        now = time.perf_counter() if now is None else now
        if self.last is None:
            self.m.ttft.labels(pipeline).observe(now - self.t0)
            n -= 1  # the other tokens of the first batch came with it
            gap = 0.0
        else:
            gap = (now - self.last) / n
        h = self.m.itl.labels(pipeline)
        for _ in range(n):
            h.observe(gap)
        self.last = now
