"""The gateway's Prometheus metrics (its own registry, or the co-hosting router's; never on the
gateway's public port: serving/openai/server.py says where they are served):

  pddjax_openai_requests_total{endpoint,code}  requests answered, by endpoint (chat, completions)
                                               and HTTP status; an error inside a started stream
                                               counts its status (the SSE error event's), a client
                                               that went away mid-request counts 499
  pddjax_openai_ttft_seconds{endpoint}         request received -> first token sent on
  pddjax_openai_itl_seconds{endpoint}          gap between consecutive tokens sent on (a router
                                               message of k tokens counts k gaps of dt/k)
  pddjax_openai_inflight                       requests being answered
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from serving.metrics import LATENCY_BUCKETS

ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)
CLIENT_GONE = 499  # nginx's "client closed request"


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter("pddjax_openai_requests", "requests answered, by endpoint and HTTP status",
                                ["endpoint", "code"], registry=r)
        self.ttft = Histogram("pddjax_openai_ttft_seconds", "request received -> first token sent on", ["endpoint"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pddjax_openai_itl_seconds", "gap between consecutive tokens sent on", ["endpoint"],
                             buckets=ITL_BUCKETS, registry=r)
        self.inflight = Gauge("pddjax_openai_inflight", "requests being answered", registry=r)

    def answered(self, endpoint: str, code: int) -> None:
        self.requests.labels(endpoint, str(code)).inc()

    def timer(self, endpoint: str, t0: float) -> TokenTimer:
        return TokenTimer(self, endpoint, t0)


class TokenTimer:
    """One request's token times: its first batch -> TTFT, every later one -> ITL."""

    def __init__(self, m: GatewayMetrics, endpoint: str, t0: float):
        self.ttft, self.itl = m.ttft.labels(endpoint), m.itl.labels(endpoint)
        self.t0, self.last = t0, None  # perf_counter times

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.ttft.observe(now - self.t0)
            n, gap = n - 1, 0.0
        else:
            gap = (now - self.last) / n
        for _ in range(n):
            self.itl.observe(gap)
        self.last = now
