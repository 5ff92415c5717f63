"""Prometheus metrics of one service process (text format over HTTP, its own registry).

Names every service exports: pddjax_rpc_total{method,code}, pddjax_rpc_seconds{method},
pddjax_rpc_inflight, and for engine roles pddjax_kv_pages_active (pages held by in-flight
requests; returns to 0 when idle; prefix-cache-only pages not counted), pddjax_kv_pages_used
(all allocated pages, prefix cache included), pddjax_kv_pages_total, pddjax_engine_sequences,
pddjax_engine_steps_total, pddjax_engine_queue_depth, pddjax_jit_compiles / pddjax_jit_executables
(step and KV copy variants built / held), pddjax_spec_drafted_tokens / pddjax_spec_accepted_tokens
(speculative decoding's draft tokens verified / accepted) and pddjax_jit_compiles_after_ready (built since the
service reported SERVING: 0 when its precompiled shape set covers the load). The router adds its own (TTFT, ITL,
admission, pipelines, handoffs, failures, WAN bytes: `router_metrics.py`) on `registry`.
The endpoint (serving/metrics_http.py: timeouts, bounded connections) listens on an ephemeral port
of the service's host; its URL goes in the ready file
and in `pddjax up`'s state file.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from serving.metrics_http import MetricsEndpoint

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServiceMetrics:
    def __init__(self, role: str):
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        self.rpc_total = Counter("pddjax_rpc", "RPCs finished, by method and status code", ["method", "code"],
                                 registry=r)
        self.rpc_seconds = Histogram("pddjax_rpc_seconds", "RPC duration", ["method"], buckets=LATENCY_BUCKETS,
                                     registry=r)
        self.inflight = Gauge("pddjax_rpc_inflight", "RPCs in progress", registry=r)
        self.pages_active = Gauge("pddjax_kv_pages_active", "KV pages held by in-flight requests", registry=r)
        self.pages_used = Gauge("pddjax_kv_pages_used", "KV pages allocated (prefix cache included)", registry=r)
        self.pages_total = Gauge("pddjax_kv_pages_total", "KV pages in the pool", registry=r)
        self.sequences = Gauge("pddjax_engine_sequences", "sequences on the engine", registry=r)
        self.steps = Gauge("pddjax_engine_steps_total", "engine steps run", registry=r)
        self.queue_depth = Gauge("pddjax_engine_queue_depth", "commands waiting for the engine thread", registry=r)
        self.compiles = Gauge("pddjax_jit_compiles", "jitted step / KV copy variants built in this process",
                              registry=r)
        self.compiles_after_ready = Gauge("pddjax_jit_compiles_after_ready",
                                          "jitted step / KV copy variants built since the service reported SERVING "
                                          "on the request path (the background build's apart)", registry=r)
        self.background_compiles = Gauge("pddjax_jit_background_compiles",
                                         "step shapes built in the background since SERVING (ready = \"cover\")",
                                         registry=r)
        self.background_pending = Gauge("pddjax_jit_background_pending",
                                        "step shapes of the stated set the background build has still to build",
                                        registry=r)
        self.executables = Gauge("pddjax_jit_executables", "jitted step / KV copy variants held in memory now",
                                 registry=r)
        self._faults_counted = 0
        self.spec_drafted = Gauge("pddjax_spec_drafted_tokens", "draft tokens verified (speculative decoding)",
                                  registry=r)
        self.spec_accepted = Gauge("pddjax_spec_accepted_tokens", "draft tokens accepted (speculative decoding)",
                                   registry=r)
        self.stream_entries = Counter("pddjax_decode_stream_entries", "request entries sent on DecodeStreams (a "
                                      "request's tokens in one message; per token: < 1 when held to an interval)",
                                      registry=r)
        self.engine_faults = Counter("pddjax_engine_faults", "engine steps that raised (their sequences failed)",
                                     registry=r)
        self.url: str | None = None
        self.endpoint: MetricsEndpoint | None = None

    def serve_http(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start the /metrics endpoint (its own thread, bounded: serving/metrics_http.py); returns its URL."""
        self.endpoint = MetricsEndpoint(self.registry, host, port)
        self.url = f"http://{host}:{self.endpoint.port}/metrics"
        return self.url

    def engine_snapshot(self, snap: dict) -> None:
        """Values read on the engine thread (see EngineWorker.snapshot)."""
        self.pages_active.set(snap["pages_active"])
        self.pages_used.set(snap["pages_used"])
        self.pages_total.set(snap["pages_total"])
        self.sequences.set(snap["sequences"])
        self.steps.set(snap["steps"])
        self.queue_depth.set(snap["queue_depth"])
        self.compiles.set(snap.get("compiles", 0))
        self.compiles_after_ready.set(snap.get("compiles_after_ready", 0))
        self.background_compiles.set(snap.get("background_compiles", 0))
        self.background_pending.set(snap.get("background_pending", 0))
        self.executables.set(snap.get("executables", 0))
        self.spec_drafted.set(snap.get("spec_drafted", 0))
        self.spec_accepted.set(snap.get("spec_accepted", 0))
        faults = snap.get("faults", 0) - self._faults_counted
        if faults > 0:
            self.engine_faults.inc(faults)
            self._faults_counted += faults
