"""What to simulate: the deployment (pools, line, policy) and the SLA it is judged by.

Modes:
- "pdd":      P and RLD in datacenter A, MD in datacenter B, joined by the WAN line; the
              router sends high-hit requests P-MD and low-hit ones P-RLD-MD (or P-RLD for
              singular requests, or for every low-hit request when `rld_normal_path`).
- "pd-cross": P in A, D (= MD) in B; every request P-MD over the WAN (no relay).
- "pd-local": P and D both in A over RDMA (the same-datacenter PD baseline).
The `d` pool is MD for "pdd"/"pd-cross" and the local D pool for "pd-local". Users connect
to datacenter A, so tokens decoded in B reach them one WAN latency later (`user_lag_s`).

`host` (a HostConfig) puts every instance on one machine with shared cores and runs them
step by step like pddjax's engines (`pddjax bench serve`); see host.py, engine_prefill.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pddjax.policy import PolicyConfig

_POLICY = PolicyConfig()  # the router's defaults, where the simulator shares them

MODES = ("pdd", "pd-cross", "pd-local")


@dataclass(frozen=True)
class Pool:
    """`count` identical instances with timing model `perf` (RooflineInstance / MeasuredInstance)."""

    perf: object
    count: int

    @property
    def cost_per_hour(self) -> float:
        return self.count * self.perf.cost_per_hour

    @property
    def chips(self) -> int:
        return self.count * self.perf.chips


@dataclass(frozen=True)
class HostConfig:
    """One machine running every instance (`pddjax bench serve`), and the engines' settings."""

    cores: float = 2.0  # CPU cores the services share
    background_cores: float = 0.0  # demand of other processes on the host, all the time
    step_cores: float = 2.0  # cores a prefill step keeps busy when it runs alone (XLA threads)
    decode_cores: float = 2.0  # cores a decode / extend step of RLD, MD keeps busy alone
    step_tokens: int = 256  # the engines' max_step_tokens
    max_rows: int = 16  # the engines' max_rows
    pad_limit: float = 1.5  # the engines' pad_limit (prompt rows of a step: B x Q <= pad_limit x T)
    page_size: int = 16
    kv_pages: int = 1024  # KV pages per engine (P's cache, RLD's, MD's DRC share them)
    chunk_bytes: int = 2 * 1024 * 1024  # KVChunk size of P's pushes (the router's chunk_bytes)
    request_overhead_s: float = 0.0  # router's own work per request before its first RPC
    rpc_s: float = 0.0  # one router -> engine RPC's round trip besides the wait for the engine thread
    export_s_per_token: float = 0.0  # P's engine thread: KV export, per token streamed
    serialize_s_per_token: float = 0.0  # P, beside the engine (one core): chunking + protobuf per token sent
    import_s_per_token: float = 0.0  # a receiver's engine thread: parse + import per token received
    unshaped_gbps: float = 1.0  # the A -> B link while the history phase replays (unshaped)
    push_window_bytes: float = 4 * 1024 * 1024  # bytes a WAN push may have unacknowledged (HTTP/2 window)
    # Cores each service is pinned to, as `bench serve` records them: (("prefill", (0,)),
    # ("relay", (1,)), ("main", (1,))); empty = every service shares all `cores`. Services on
    # the same set share one Host; sets must be equal or disjoint.
    cpus: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # Pinned core sets still share the memory system: ("x|y", s) = a step of class x runs s
    # times slower while another core set runs one of class y (`host.step_class`; measured by
    # tools/hostlab; empty = none).
    cross_slowdown: tuple[tuple[str, float], ...] = ()

    @property
    def kv_tokens(self) -> int:
        return self.kv_pages * self.page_size


@dataclass(frozen=True)
class ClusterConfig:
    mode: str
    p: Pool
    d: Pool
    rld: Pool | None = None
    wan_gbps: float = 25.0
    wan_latency_s: float = 0.005  # one-way
    wan_jitter_s: float = 0.002  # mean of the exponential extra delay
    wan_sharing: str = "fair"  # "fair" (processor sharing) or "fifo"
    fast_gbps: float = 400.0  # intra-datacenter RDMA per sending instance
    fast_latency_s: float = 10e-6
    handoff: str = "chunked"  # "chunked" (extend-decode handoff) or "oneshot"
    chunk_threshold: int = 64  # the paper scenario's tail-chunk size (the router's own default is _POLICY's)
    batch_extend: bool = True  # extend chunks ride in decode steps (False: passes of their own)
    rld_threshold_s: float = _POLICY.ttft_budget_s  # use RLD when the KV is predicted to reach MD later than this
    singular_filter: bool = True  # finish on RLD if it would be done before the KV reaches MD
    rld_normal_path: bool = False  # drift experiment: low-hit requests end on RLD (P-RLD)
    drc: bool = True  # decode side keeps a prefix cache (DRC)
    tpot_target_s: float = 0.05  # decode batch is capped so a step fits this
    seed: int = 0
    # The router's policy (pddjax.policy): rld_threshold_s is its TTFT budget.
    # filter_cap and drift_tolerance default off here (the paper's setting); the router's are _POLICY's.
    filter_cap: float = 1.0  # share of recent decisions the singular filter may take
    filter_window: int = _POLICY.filter_window
    drift_tolerance: float = float("inf")  # sessions lagging more on MD are never filtered
    rld_prior_tokens_per_s: float | None = None  # RLD speed before the first measurement (None: profile)
    wan_prior_gbps: float | None = None  # link throughput before the first transfer (None: the line's)
    cancel_late_transfers: bool = True  # RLD finished first: cancel the WAN push (router: let it finish)
    # link samples: from the push's first byte ("first_byte"), from P's admission ("admission"),
    # or the push's time less its waits on P's prefill ("wire": TransferDone.wire_ms, the router)
    link_timing: str = "first_byte"
    user_lag_s: float | None = None  # B -> user delay of tokens decoded in B (None: WAN latency)
    host: HostConfig | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if self.mode == "pdd" and (self.rld is None or self.rld.count < 1):
            raise ValueError("pdd needs at least one RLD instance")
        if self.p.count < 1 or self.d.count < 1:
            raise ValueError("need at least one P and one decode instance")
        if self.handoff not in ("chunked", "oneshot"):
            raise ValueError("handoff must be chunked or oneshot")

    @property
    def cost_per_hour(self) -> float:
        rld = self.rld.cost_per_hour if (self.rld and self.mode == "pdd") else 0.0
        return self.p.cost_per_hour + self.d.cost_per_hour + rld

    def describe(self) -> dict:
        """JSON-friendly summary of the deployment."""
        def pool(p: Pool | None):
            return None if p is None else {"count": p.count, "instance": p.perf.name, "chips": p.chips}
        return {
            "mode": self.mode, "P": pool(self.p), "D" if self.mode == "pd-local" else "MD": pool(self.d),
            "RLD": pool(self.rld) if self.mode == "pdd" else None, "wan_gbps": self.wan_gbps,
            "cost_per_hour": round(self.cost_per_hour, 3),
        }

    def replace(self, **kw) -> ClusterConfig:
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class Sla:
    """A request meets the SLA if TTFT <= ttft_s and TPOT <= tpot_s; a load meets it if at
    least `attain` of the measured requests do."""

    ttft_s: float = 5.0
    tpot_s: float = 0.1
    attain: float = 0.9
