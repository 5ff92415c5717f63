"""Service and stack configuration: one TOML (or JSON) file describes the whole stack; a
service reads the top-level defaults, `[engine]`, and its own role's table on top.

    model = "tiny"            # tiny | smollm2-135m | PATH.gguf
    max_context = 2048        # optional: tokens (prompt + output) a request may hold, below the
                              # model's own context (SmolLM2-135M: 8192); every role serves the
                              # same cap: narrower page tables, fewer step shapes to build
    platform = "cpu"          # JAX backend: cpu | gpu | tpu
    host = "127.0.0.1"
    insecure = false          # plaintext on a non-loopback host only with this (or --insecure)
    reflection = false        # grpc reflection on the service ports (also per role table)
    max_concurrent_rpcs = 4096  # RPCs a service port serves at once, open streams included (also
                              # per role table); one more answers RESOURCE_EXHAUSTED at once
    [engine]                  # defaults for prefill, relay, main
    dtype = "float32"; page_size = 16; num_pages = 256; attention = "auto"
    max_step_tokens = 256; max_rows = 32; prefix_cache = true; pad_limit = 1.5
    tensor_parallel = 1       # devices per engine (a named model's degree is checked here)
                              # (exactly EngineConfig's fields, pddjax/engines/engine_config.py)
    [prefill] / [relay] / [main]    # per-role overrides of the above (+ port, platform, model)
                              # [prefill] kv_peers = ["host:port", ...]: where P may push KV
                              # (RLD, and MD as P reaches it: the WAN link's address); kv_peers_file
                              # = a JSON list of more, re-read when it changes (`pddjax up` writes
                              # one); neither: loopback addresses only (serving/authz.py)
                              # [relay] handoff_peers = ["host:port", ...]: the MD addresses RLD
                              # may hand off to (MD as RLD reaches it: the router's main_wan);
                              # unset: any HOST:PORT (serving/engine/handoff.py)
                              # coordinator_address = "HOST:PORT", num_processes, process_id: one
                              # instance over several hosts (engines/multihost.py; flags override)
    [router]                  # port; prefill/relay/main: address lists (several instances per
                              # role), main_wan (MD as cluster A reaches it, parallel to main),
                              # relay_kv (RLD as P reaches it with KV, parallel to relay);
                              # handoff ("auto" | "one-shot" | "chunked"), handoff_threshold,
                              # give_up_main = true: MD is given up for a pdd request predicted
                              # to end on RLD before the stream could switch (serving/router/give_up.py),
                              # chunk_bytes; auto policy: ttft_budget_ms, filter_cap, filter_window,
                              # drift_tolerance, *_prior estimates; health_interval_s/_timeout_s;
                              # the link to each MD: wan_mbps = its provisioned A -> B capacity
                              # (0 = unknown; else the estimate's prior and its cap), wan_probe =
                              # true: measured (RTT, bandwidth; < 3 s, <= ~4 MiB) at the router's
                              # start and when an MD rejoins, then refreshed by transfers; an auto
                              # request waits up to wan_probe_wait_ms for its MD's first probe
                              # admission: max_inflight = 256 requests served at once, max_queue =
                              # 512 waiting for a slot; past both Generate answers RESOURCE_EXHAUSTED
                              # default_deadline_s = 600: a Generate without a deadline gets this one;
                              # max_deadline_s = 1800: a longer one (gRPC's or the gateway's) is cut to it;
                              # sync_timeout_s = 120, max_sync_waiting = 64: background context syncs
                              # relay_kv_wire = the KV wire format of P -> RLD (default "native")
                              # stream_interval = 1 token per user message, stream_interval_ms = 0
                              # (the longest a ready token waits; 0: no bound); a request may ask coarser;
                              # interval_at_source = true: RLD / MD hold the tokens to it (false: the router)
    [wan]                     # mbps (0 = unlimited), latency_ms  (pddjax up's A -> B link);
                              # kv_wire = the KV wire format of P -> MD over the WAN: native | bf16 |
                              # int8 | fp8, each optionally "+zstd" (pddjax/kv/codec.py; default
                              # native, the only exact one; the router's [router] kv_wire is the same
                              # setting and wins); a target that did not declare it gets native

Swapping a cluster's hardware is a change of `platform`, `dtype`, `page_size`, `attention`
and `num_pages` in that role's table.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from importlib import resources

from pddjax.engines.engine_config import EngineConfig, degree_problem
from pddjax.errors import UserError
from pddjax.kv.codec import FORMATS as KV_WIRE_FORMATS
from pddjax.model.config import NAMED_CONFIGS
from pddjax.policy import PolicyConfig

ENGINE_ROLES = ("prefill", "relay", "main")
ROLES = (*ENGINE_ROLES, "router")
ENGINE_KEYS = frozenset(f.name for f in dataclasses.fields(EngineConfig))  # a role's engine table
_POLICY = PolicyConfig()  # the auto policy's defaults live there once
MAX_STREAM_INTERVAL, MAX_STREAM_INTERVAL_MS = 1024, 60_000  # [router] and per request (serving/router/interval.py)
DEFAULT_STACK = "default_stack.toml"  # package data of `serving` (pyproject.toml): `pddjax up` without --config


@dataclasses.dataclass
class RouterSettings:
    prefill: list[str] = dataclasses.field(default_factory=list)  # P instances (a string = one)
    relay: list[str] = dataclasses.field(default_factory=list)
    main: list[str] = dataclasses.field(default_factory=list)
    main_wan: list[str] = dataclasses.field(default_factory=list)  # MD as cluster A reaches it (parallel to main)
    relay_kv: list[str] = dataclasses.field(default_factory=list)  # RLD as P reaches it with KV (parallel to relay)
    handoff: str = "auto"  # "auto" (chunked while more than the threshold is pending) | "one-shot" | "chunked"
    handoff_threshold: int = _POLICY.handoff_threshold
    give_up_main: bool = True  # pdd: no handoff (or stop it) when the request ends on RLD before the switch
    handoff_switch_prior_s: float = 0.0  # give_up_main: the switch time assumed before an MD's first (0: none)
    tool_parser: str = ""  # the tool-call syntax ("hermes" | "llama3" | "mistral"); "": the chat template's
    chunk_bytes: int = 2 * 1024 * 1024
    ttft_budget_ms: float = _POLICY.ttft_budget_s * 1e3  # auto: pd-cross when MD's KV delta arrives within this
    filter_cap: float = _POLICY.filter_cap  # auto: at most this share of recent requests filtered to pd-local
    filter_window: int = _POLICY.filter_window
    drift_tolerance: float = _POLICY.drift_tolerance  # auto: no filter for a session whose MD hit lags P's by more
    wan_mbps_prior: float = 1000.0  # link estimates before the first measured transfer
    wan_latency_ms_prior: float = 20.0
    wan_mbps: float = 0.0  # the provisioned A -> B capacity: prior and cap of the link estimate (0 = unknown)
    wan_probe: bool = True  # measure each MD's link at start and when it rejoins (estimates.py)
    wan_probe_wait_ms: float = 2000.0  # an auto request waits this long at most for its MD's first probe
    rld_tokens_per_s_prior: float = 50.0
    health_interval_s: float = 1.0  # grpc.health.v1 checks of every instance
    health_timeout_s: float = 2.0
    background_timeout_s: float = 300.0  # a KV push finishing after its request (MD's context) gives up after this
    max_inflight: int = 256  # requests served at once (router_admission.py)
    max_queue: int = 512  # requests waiting (FIFO) for a slot; past both: RESOURCE_EXHAUSTED at once
    default_deadline_s: float = 600.0  # a Generate that brings no deadline gets this one (never unbounded)
    max_deadline_s: float = 1800.0  # a Generate's deadline at most: a longer one is cut to it (holds no slot longer)
    sync_timeout_s: float = 120.0  # a background context sync to MD (a filtered turn) gives up after this
    max_sync_waiting: int = 64  # syncs queued behind the one running; past it a new one is dropped (counted)
    kv_wire: str = "native"  # KV wire format P -> MD (the WAN; `[wan] kv_wire`), pddjax.kv.codec.FORMATS
    relay_kv_wire: str = "native"  # KV wire format P -> RLD (the fast link)
    stream_interval: int = 1  # tokens per user message (1..1024; a request may ask coarser only)
    stream_interval_ms: float = 0.0  # the longest a ready token waits before it is sent (0: no time bound)
    interval_at_source: bool = True  # RLD / MD hold a request's tokens to its interval (false: the router groups them)

    def __post_init__(self):
        for f in ("prefill", "relay", "main", "main_wan", "relay_kv"):
            v = getattr(self, f)
            setattr(self, f, [a for a in v.split(",") if a] if isinstance(v, str) else list(v))
        if float(self.wan_mbps) < 0 or float(self.wan_probe_wait_ms) < 0:
            raise UserError(f"[router] wan_mbps and wan_probe_wait_ms must be >= 0, "
                            f"got {self.wan_mbps} and {self.wan_probe_wait_ms}")
        positive = float(self.default_deadline_s) > 0 and float(self.sync_timeout_s) > 0
        if not float(self.default_deadline_s) <= float(self.max_deadline_s) < float("inf"):
            raise UserError(f"[router] max_deadline_s must be finite and at least default_deadline_s, "
                            f"got {self.max_deadline_s} and {self.default_deadline_s}")
        if not positive or int(self.max_sync_waiting) < 0:
            raise UserError(f"[router] default_deadline_s and sync_timeout_s must be > 0 and max_sync_waiting >= 0, "
                            f"got {self.default_deadline_s}, {self.sync_timeout_s} and {self.max_sync_waiting}")
        if int(self.max_inflight) < 1 or int(self.max_queue) < 0:
            raise UserError(f"[router] max_inflight must be >= 1 and max_queue >= 0, "
                            f"got {self.max_inflight} and {self.max_queue}")
        if not (1 <= int(self.stream_interval) <= MAX_STREAM_INTERVAL
                and 0 <= float(self.stream_interval_ms) <= MAX_STREAM_INTERVAL_MS):
            raise UserError(f"[router] stream_interval must be in 1..{MAX_STREAM_INTERVAL} tokens and "
                            f"stream_interval_ms in 0..{MAX_STREAM_INTERVAL_MS}, got {self.stream_interval} "
                            f"and {self.stream_interval_ms}")
        if not isinstance(self.interval_at_source, bool):
            raise UserError(f"[router] interval_at_source must be true or false, got {self.interval_at_source!r}")
        if not isinstance(self.give_up_main, bool) or not 0 <= float(self.handoff_switch_prior_s) < float("inf"):
            raise UserError(f"[router] give_up_main must be true or false and handoff_switch_prior_s a finite "
                            f"number >= 0, got {self.give_up_main!r} and {self.handoff_switch_prior_s!r}")
        for key in ("kv_wire", "relay_kv_wire"):
            if getattr(self, key) not in KV_WIRE_FORMATS:
                raise UserError(f"{'[wan] kv_wire' if key == 'kv_wire' else '[router] relay_kv_wire'} must be one of "
                                f"{', '.join(KV_WIRE_FORMATS)}, got {getattr(self, key)!r}")
        for kv, role in (("main_wan", "main"), ("relay_kv", "relay")):
            if getattr(self, kv) and len(getattr(self, kv)) != len(getattr(self, role)):
                raise UserError(f"[router] {kv} lists {len(getattr(self, kv))} addresses "
                                f"for {len(getattr(self, role))} {role} instances")


@dataclasses.dataclass
class ServiceConfig:
    role: str
    model: str = "tiny"
    platform: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    engine: dict = dataclasses.field(default_factory=dict)  # EngineConfig fields (checked)
    router: RouterSettings = dataclasses.field(default_factory=RouterSettings)
    insecure: bool = False  # plaintext allowed on a non-loopback host (serving/security.py)
    reflection: bool = False  # grpc reflection on this service's port
    max_concurrent_rpcs: int = 4096  # RPCs its port serves at once (streams count); past it RESOURCE_EXHAUSTED
    kv_peers: list[str] = dataclasses.field(default_factory=list)  # prefill: where it may push KV (authz.KVPeers)
    kv_peers_file: str | None = None  # prefill: a JSON list of more, re-read when it changes
    handoff_peers: list[str] = dataclasses.field(default_factory=list)  # relay: MD addresses it may hand off to
    max_context: int | None = None  # the stack's cap on a request's tokens (None: the model's context)
    # a multi-host instance (pddjax/engines/multihost.py): process 0 serves, the others follow its steps
    coordinator_address: str | None = None  # HOST:PORT of process 0's jax.distributed coordinator
    num_processes: int = 1
    process_id: int = 0


def read_file(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(f"cannot read config {path}: {e.strerror}") from None
    try:
        return json.loads(data) if path.endswith(".json") else tomllib.loads(data.decode())
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"config {path} is not valid {'JSON' if path.endswith('.json') else 'TOML'}: {e}") from None


def default_stack() -> dict:
    """The packaged default stack config, found through importlib.resources (an installed wheel too)."""
    return tomllib.loads(resources.files("serving").joinpath(DEFAULT_STACK).read_text(encoding="utf-8"))


def service_config(stack: dict, role: str, port: int | None = None) -> ServiceConfig:
    if role not in ROLES:
        raise UserError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
    section = dict(stack.get(role, {}))
    cfg = ServiceConfig(role, model=section.pop("model", stack.get("model", "tiny")),
                        platform=section.pop("platform", stack.get("platform")),
                        host=section.pop("host", stack.get("host", "127.0.0.1")), port=int(section.pop("port", 0)))
    if port is not None:
        cfg.port = port
    for key in ("insecure", "reflection"):  # top level, or the role's table
        setattr(cfg, key, bool(section.pop(key, stack.get(key, False))))
    cfg.max_context = _max_context(stack)
    rpcs = section.pop("max_concurrent_rpcs", stack.get("max_concurrent_rpcs", cfg.max_concurrent_rpcs))
    if isinstance(rpcs, bool) or not isinstance(rpcs, int) or rpcs < 1:
        raise UserError(f"[{role}] max_concurrent_rpcs must be an integer >= 1, got {rpcs!r}")
    cfg.max_concurrent_rpcs = rpcs
    if role == "prefill":
        cfg.kv_peers = _addresses(section.pop("kv_peers", []))
        cfg.kv_peers_file = section.pop("kv_peers_file", None)
    if role == "relay":
        cfg.handoff_peers = _addresses(section.pop("handoff_peers", []))
    if role == "router":
        known = {f.name for f in dataclasses.fields(RouterSettings)}
        unknown = set(section) - known
        if unknown:
            raise UserError(f"unknown [router] key {sorted(unknown)[0]!r}")
        if "kv_wire" in stack.get("wan", {}):  # MD's WAN path: the [wan] table names its format
            section.setdefault("kv_wire", stack["wan"]["kv_wire"])
        cfg.router = RouterSettings(**section)
        if cfg.router.handoff not in ("auto", "one-shot", "chunked"):
            raise UserError(f"[router] handoff must be auto, one-shot or chunked, got {cfg.router.handoff!r}")
        if cfg.router.tool_parser not in ("", "hermes", "llama3", "mistral"):
            raise UserError(f"[router] tool_parser must be hermes, llama3 or mistral (or left out: the chat "
                            f"template's), got {cfg.router.tool_parser!r}")
        return cfg
    for key, cast in (("coordinator_address", str), ("num_processes", int), ("process_id", int)):
        if key in section:  # the role's table only: each host's process gets its own id
            try:
                setattr(cfg, key, cast(section.pop(key)))
            except (TypeError, ValueError):
                raise UserError(f"[{role}] {key} must be {'HOST:PORT' if cast is str else 'an integer'}") from None
    problem = multihost_problem(cfg)
    if problem:
        raise UserError(f"[{role}] {problem}")
    engine = {**stack.get("engine", {}), **section}
    unknown = set(engine) - ENGINE_KEYS
    if unknown:
        raise UserError(f"unknown engine key {sorted(unknown)[0]!r} for {role} "
                        f"(known: {', '.join(sorted(ENGINE_KEYS))})")
    problem = EngineConfig(**engine).check()
    known = NAMED_CONFIGS.get(cfg.model)  # a named model's heads are known here (a file's: at engine start)
    if not problem and known is not None and engine.get("tensor_parallel", 1) != 1:
        problem = degree_problem(engine["tensor_parallel"], known.num_heads, known.num_kv_heads)
    if problem:
        raise UserError(f"[{role}] {problem}")
    cfg.engine = engine
    return cfg


def _max_context(stack: dict) -> int | None:
    """The top-level `max_context` (one value for every role: the router and each tier must agree
    on what fits), or None."""
    value = stack.get("max_context")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 16:
        raise UserError(f"max_context must be an integer of at least 16 tokens (prompt + output per request), "
                        f"got {value!r}")
    return value


def capped_context(model_config, max_context: int | None):
    """`model_config` serving at most `max_context` tokens per request (never more than its own)."""
    if max_context is None or max_context >= model_config.max_context:
        return model_config
    return model_config.replace(max_context=max_context)


def _addresses(value) -> list[str]:
    """An address list as a table states it: a list, or one comma-separated string."""
    return [a for a in value.split(",") if a] if isinstance(value, str) else [str(a) for a in value]


def multihost_problem(cfg: ServiceConfig) -> str | None:
    """One sentence on a multi-host setting that cannot work (flags and config alike), or None."""
    n, i, coord = cfg.num_processes, cfg.process_id, cfg.coordinator_address
    if n < 1 or not 0 <= i < n:
        return f"process_id must be in [0, num_processes) and num_processes >= 1, got {i} of {n}"
    if n > 1 and (not coord or ":" not in coord or not coord.rsplit(":", 1)[1].isdigit()):
        return f"a multi-host instance of {n} processes needs coordinator_address = HOST:PORT, got {coord!r}"
    return None
