"""Build and run one service process: `pddjax serve {prefill,relay,main,router}`.

Engine roles: configure JAX for the role's platform, load the model, build a PagedEngine
from the role's engine table, precompile its step shapes (`PagedEngine.precompile`, `[engine]
ready`: "cover", a covering few, the rest built in the background while it serves; "all", the
whole stated set; one log line with the count and seconds), start its engine thread, then
serve; from SERVING on `pddjax_jit_compiles_after_ready` counts what compiles on the request
path (0 expected; the background build's are `pddjax_jit_background_compiles`). A multi-host
instance builds the whole set first (its processes replay the same calls). The port and
the metrics endpoint open first: while the model loads and compiles, grpc.health.v1 says
NOT_SERVING and every RPC answers UNAVAILABLE (lifecycle.Gate). A `ready_file` (JSON {role,
pid, address, metrics, startup: where the start went, pddjax/engines/startup_clock.py}) is
written once serving. Security (`listen`): no plaintext on a non-loopback host without
`insecure`, the role's own TLS identity, callers authorised by role (serving/authz.py),
reflection only when asked for. SIGTERM/SIGINT drain: new RPCs get UNAVAILABLE, in-flight ones finish
(up to DRAIN_SECONDS), then the server stops.

A multi-host instance (`num_processes` > 1, pddjax/engines/multihost.py): process 0 is this
service, its engine's device calls logged to the others; processes 1.. run `follow_leader`
(the same engine, no port) until process 0 has drained and stops them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal

import grpc

from pddjax.errors import UserError
from serving import authz, rpc, security
from serving.config import ServiceConfig, capped_context
from serving.gate import Gate, register
from serving.metrics import ServiceMetrics
from serving.pb import cluster_pb2, router_pb2
from serving.stack import probes

DRAIN_SECONDS = 30.0
STOP_GRACE_SECONDS = 2.0  # the gRPC server's own stop, after the drain


def drain_budget(openai: bool = False) -> float:
    """The longest SIGTERM's drain takes (a pod's grace period must exceed it: deploy/): the
    Gate's, the co-hosted gateway's (its requests, then uvicorn's graceful shutdown), the stop."""
    from serving.openai.server import SHUTDOWN_GRACE_S

    return DRAIN_SECONDS + (DRAIN_SECONDS + SHUTDOWN_GRACE_S if openai else 0) + STOP_GRACE_SECONDS

# The gRPC service each role answers (the gate registers its methods: serving/gate.py).
SERVICES = {
    "prefill": cluster_pb2.DESCRIPTOR.services_by_name["Prefill"],
    "relay": cluster_pb2.DESCRIPTOR.services_by_name["Decode"],
    "main": cluster_pb2.DESCRIPTOR.services_by_name["Decode"],
    "router": router_pb2.DESCRIPTOR.services_by_name["Router"],
}


def build_servicer(cfg: ServiceConfig, clock=None):
    """The role's servicer: the router (model facts only, no JAX) or an engine service. `clock`
    (a StartupClock) times the phases."""
    if cfg.role == "router":
        from pddjax.model.gguf_meta import GGUFError
        from pddjax.model.hf_config import CheckpointError
        from pddjax.model.meta import ModelNotFound, model_facts
        from serving.router.service import RouterService

        try:
            mcfg, tok = model_facts(cfg.model)
        except (ModelNotFound, GGUFError, CheckpointError) as e:  # missing or unreadable: one sentence
            raise UserError(f"the router cannot read model {cfg.model}: {e}") from None
        return RouterService(cfg.router, capped_context(mcfg, cfg.max_context), tok)
    import jax

    model, ecfg, engine, _ = build_engine(cfg, clock)
    info = dict(role=rpc.ROLE_NAMES[cfg.role], model=model.config.name, fingerprint=model.fingerprint, dtype=ecfg.dtype,
                page_size=ecfg.page_size, num_pages=ecfg.num_pages, prefix_cache=ecfg.prefix_cache,
                num_layers=model.config.num_layers, num_kv_heads=model.config.num_kv_heads,
                head_dim=model.config.head_dim, platform=jax.default_backend(), attention=ecfg.attention)
    if cfg.role == "prefill":
        from serving.engine.prefill import PrefillService

        return PrefillService(engine, model.config, info, authz.KVPeers(cfg.kv_peers, cfg.kv_peers_file))
    from serving.engine.decode import DecodeService

    return DecodeService(cfg.role, engine, model.config, info, handoff_peers=cfg.handoff_peers)


def build_engine(cfg: ServiceConfig, clock=None):
    """JAX set up, the model loaded, the role's engine built and precompiled -> (model, ecfg,
    engine, channel). A multi-host instance joins its group first (engines/multihost.py): the
    channel is process 0's Leader (its engine a `multihost.LeaderEngine`) or another process's Follower; None
    for a one-process instance."""
    from pddjax.engines.startup_clock import install, phase
    from pddjax.model.jax_setup import configure

    with phase(clock, "jax_s"):
        tp = int(cfg.engine.get("tensor_parallel", 1))
        configure(cfg.platform, devices=max(1, tp // cfg.num_processes))  # CPU: fake devices for TP (this host's share)
        install()  # JAX's compile events summed from here on
    from pddjax.engines import multihost

    tls = op_channel_tls(cfg.role) if cfg.num_processes > 1 else None
    channel = multihost.join(cfg.coordinator_address, cfg.num_processes, cfg.process_id, tls=tls,
                             insecure=cfg.insecure)  # None: one process

    from pddjax.engines.paged_engine import EngineConfig, PagedEngine
    from serving.engine.grammars import compiler_for

    with phase(clock, "weights_s"):
        model = load_model_or_refuse(cfg.model)
    model = dataclasses.replace(model, config=capped_context(model.config, cfg.max_context))
    ecfg = EngineConfig(**cfg.engine)
    with phase(clock, "engine_s"):  # the weights laid out and placed, the pool allocated
        if isinstance(channel, multihost.Leader):  # its engine tells the followers of each device call
            engine = multihost.LeaderEngine(model.config, model.weights, model.fingerprint, ecfg, leader=channel)
        else:
            engine = PagedEngine(model.config, model.weights, model.fingerprint, ecfg, grammar=compiler_for(model))
    ready = "all" if cfg.num_processes > 1 else ecfg.ready  # a group's processes build the same set
    variants, seconds = engine.precompile(ready, clock)
    rest = f"; {len(engine.stated) - len(engine.shapes)} more building in the background" if engine.background else ""
    print(f"pddjax {cfg.role} precompiled {variants} variants ({len(engine.shapes)} of {len(engine.stated)} step "
          f"shapes) in {seconds:.1f} s{rest}", flush=True)
    return model, ecfg, engine, channel


def _refresh_gauges(engine) -> None:
    """A no-op command: the engine thread refreshes its gauges after every command."""


def startup_report(clock, worker) -> dict:
    """The ready file's `startup`: the clock's phases and JAX totals, and for an engine the
    shapes built before SERVING and those left to the background build."""
    extra = {}
    engine = getattr(worker, "engine", None)
    if engine is not None and hasattr(engine, "stated"):
        extra = {"shapes": len(engine.shapes), "stated": len(engine.stated),
                 "background_total": engine.background.variants_total if engine.background else 0}
    return clock.report(**extra)


def load_model_or_refuse(name: str):
    """registry.load_model, its refusals (a missing name, a hostile or broken GGUF / checkpoint) as
    a UserError: `pddjax serve` prints one `pddjax: error:` line and exits 2."""
    from pddjax.model.gguf_meta import GGUFError
    from pddjax.model.registry import CheckpointError, ModelNotFound, load_model

    try:
        return load_model(name)
    except (ModelNotFound, GGUFError, CheckpointError) as e:
        raise UserError(str(e)) from None


def op_channel_tls(role: str):
    """A multi-host instance's op channel identity: the role's certificate files, the peer the
    role's own (engines/multihost_channel.py); None without a TLS directory. Unusable material:
    UserError with one sentence."""
    import ssl

    from pddjax.engines.multihost_channel import ChannelTLS

    if security.role_material(role) is None:  # (reads each file: one sentence if one cannot be)
        return None
    d = security.tls_dir()
    tls = ChannelTLS(os.path.join(d, "ca.pem"), os.path.join(d, security.cert_file(role)),
                     os.path.join(d, security.key_file(role)), security.SPIFFE_PREFIX + role)
    try:
        tls.context(server=True)
    except (OSError, ssl.SSLError) as e:
        raise UserError(f"the {role} TLS identity in {d} cannot secure the multi-host op channel: {e}") from None
    return tls


def follow_leader(cfg: ServiceConfig) -> int:
    """Process I > 0 of a multi-host instance: no port; the leader's engine, replaying its device
    calls until it stops (-> 0) or is gone (-> multihost.EXIT_LOST). SIGTERM does not end it:
    the leader drains first, then stops its followers."""
    signal.signal(signal.SIGTERM, lambda *_: print(f"pddjax {cfg.role} follower {cfg.process_id}: SIGTERM; "
                                                    "following until the leader stops", flush=True))
    _, _, engine, channel = build_engine(cfg)
    from pddjax.engines import multihost

    print(f"pddjax {cfg.role} follower {cfg.process_id}/{cfg.num_processes} following the leader at "
          f"{cfg.coordinator_address}", flush=True)
    try:
        result = multihost.follow(engine, channel)
    except Exception:  # follow logged it; no jax.distributed shutdown barrier: the leader is about to go too
        import traceback

        traceback.print_exc()
        os._exit(multihost.EXIT_LOST)
    print(f"pddjax {cfg.role} follower {cfg.process_id}: the leader {'stopped' if result == 'stop' else 'is gone'}",
          flush=True)
    if result != "stop":
        os._exit(multihost.EXIT_LOST)  # no jax.distributed shutdown: its coordinator went with the leader
    multihost.shutdown()
    return 0


@dataclasses.dataclass
class Listening:
    """A service's port, open: the server (started), its health servicer, gate and metrics."""
    server: grpc.aio.Server
    health: object  # grpc_health's aio HealthServicer
    names: list[str]  # the role's gRPC service (health reports it)
    gate: Gate
    metrics: ServiceMetrics
    address: str


async def listen(cfg: ServiceConfig) -> Listening:
    """Open the role's port (loading): the security rules first (security.listen_problem:
    UserError with one sentence), then TLS with the role's identity when configured, the
    bearer token on the router, per-role authorisation on internal ports (authz.RoleAuthz),
    health (NOT_SERVING) and reflection only if `cfg.reflection`; at most
    `cfg.max_concurrent_rpcs` RPCs at once (one more: RESOURCE_EXHAUSTED)."""
    public = cfg.role == "router"  # the port users reach: bearer token, TLS without client certificates
    token = security.router_token() if public else None
    tls = security.role_material(cfg.role) is not None
    problem = security.listen_problem(cfg.role, cfg.host, tls, cfg.insecure, token is not None)
    if problem:
        raise UserError(problem)
    interceptors = [security.BearerAuth(token)] if token else []
    if tls and not public:
        interceptors.append(authz.RoleAuthz(cfg.role))
    server = grpc.aio.server(options=rpc.SERVER_OPTIONS, interceptors=interceptors or None,
                             maximum_concurrent_rpcs=cfg.max_concurrent_rpcs)  # past it: RESOURCE_EXHAUSTED
    names = [SERVICES[cfg.role].full_name]
    hs = rpc.add_health_and_reflection(server, names, reflection_on=cfg.reflection)
    await rpc.set_serving(hs, names, False)  # the overall status "" starts SERVING in grpc's servicer
    metrics = ServiceMetrics(cfg.role)
    gate = Gate(metrics)
    register(server, SERVICES[cfg.role], gate)
    port = rpc.add_port(server, f"{cfg.host}:{cfg.port}", cfg.role)
    if port == 0:
        raise OSError(f"cannot listen on {cfg.host}:{cfg.port}")
    await server.start()
    return Listening(server, hs, names, gate, metrics, f"{cfg.host}:{port}")


async def serve(cfg: ServiceConfig, ready_file: str | None = None, openai: dict | None = None) -> None:
    """`openai` (the router only; {host, port, default_max_tokens}): the OpenAI gateway served in
    this process too, in front of the router through its Gate (serving/stack/cohost.py), its port
    open (503) while loading."""
    security.set_identity(cfg.role)  # the certificate this process dials its peers with
    lst = await listen(cfg)
    server, hs, names, gate, metrics, address = lst.server, lst.health, lst.names, lst.gate, lst.metrics, lst.address
    health_port = await probes.open_health_port(hs, cfg.host)  # PDDJAX_HEALTH_PORT: kubelet's plaintext probe
    metrics_url = metrics.serve_http(cfg.host, probes.metrics_port())
    gateway = None
    if openai is not None:
        from serving.stack import cohost

        gateway = await cohost.start(gate, address, openai["host"], openai["port"], cfg.model,
                                     security.router_token(), openai.get("default_max_tokens", 256),
                                     https=openai.get("https"), registry=metrics.registry, metrics_url=metrics_url)
        print(f"pddjax {cfg.role} OpenAI-compatible API on {gateway.info['url']}", flush=True)
    print(f"pddjax {cfg.role} loading on {address} (metrics {metrics_url})", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    from pddjax.engines.startup_clock import StartupClock  # (no jax: the router imports it too)

    clock = StartupClock()
    try:
        servicer = await loop.run_in_executor(None, build_servicer, cfg, clock)
    except BaseException:  # a model that cannot load (UserError: one line): the ports close before the exit
        if gateway is not None:
            await gateway.stop(0)
        await server.stop(grace=0)
        if health_port is not None:
            await health_port.stop(grace=0)
        raise
    servicer.start(loop)
    worker = getattr(servicer, "worker", None)
    if worker is not None:
        worker.metrics = metrics
        worker.mark_ready()  # compiles from here on: pddjax_jit_compiles_after_ready
        background = getattr(worker.engine, "background", None)
        if background is not None:  # its progress in the gauges even while no request comes
            background.on_progress = lambda: worker.run_soon(_refresh_gauges)
        metrics.engine_snapshot(await worker.call(lambda _engine: worker.snapshot()))  # gauges from SERVING on
        # repeated engine faults flip health (the router routes around), a quiet window restores it
        worker.faults.post_health = lambda ok: loop.call_soon_threadsafe(
            lambda: loop.create_task(rpc.set_serving(hs, names, ok)))
    if hasattr(servicer, "attach_metrics"):
        servicer.attach_metrics(metrics)
    gate.ready(servicer)
    await rpc.set_serving(hs, names, True)
    if ready_file:
        tmp = ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"role": cfg.role, "pid": os.getpid(), "address": address, "metrics": metrics_url,
                       "startup": startup_report(clock, worker), **({"openai": gateway.info} if gateway else {})}, f)
        os.replace(tmp, ready_file)
    print(f"pddjax {cfg.role} serving on {address}", flush=True)
    await stop.wait()
    gate.drain()  # new RPCs: UNAVAILABLE; in-flight ones finish
    if hasattr(servicer, "drain"):
        servicer.drain()  # streams kept open across requests end once idle
    await rpc.set_serving(hs, names, False)
    await gate.wait_idle(DRAIN_SECONDS)
    if gateway is not None:  # its requests drained with the RPCs (the Gate refuses new ones: 503)
        await gateway.stop(DRAIN_SECONDS)
    await server.stop(grace=STOP_GRACE_SECONDS)
    if health_port is not None:
        await health_port.stop(grace=0)
    if worker is not None:
        worker.stop()
        if getattr(worker.engine, "background", None) is not None:
            worker.engine.background.stop()  # the compile in flight ends before the process does
        leader = getattr(worker.engine, "leader", None)  # a multi-host LeaderEngine's op log
        if leader is not None:  # its followers stop, then the group ends
            from pddjax.engines import multihost

            leader.close()
            multihost.shutdown()
