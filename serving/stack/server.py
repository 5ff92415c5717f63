"""Build and run one service process: `pddjax serve {prefill,relay,main,router}`.

Engine roles: configure JAX for the role's platform, load the model, build a PagedEngine
from the role's engine table, start its engine thread, then serve. The port and the metrics
endpoint open first: while the model loads, grpc.health.v1 says NOT_SERVING and every RPC
answers UNAVAILABLE (lifecycle.Gate). A `ready_file` (JSON {role, pid, address, metrics}) is
written once serving. SIGTERM/SIGINT drain: new RPCs get UNAVAILABLE, in-flight ones finish
(up to DRAIN_SECONDS), then the server stops.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import grpc

from serving import rpc, security
from serving.config import ServiceConfig
from serving.gate import Gate, register
from serving.metrics import ServiceMetrics
from serving.pb import cluster_pb2, cluster_pb2_grpc, router_pb2, router_pb2_grpc

DRAIN_SECONDS = 30.0

ADD_TO_SERVER = {
    "prefill": (cluster_pb2.DESCRIPTOR.services_by_name["Prefill"], cluster_pb2_grpc.add_PrefillServicer_to_server),
    "relay": (cluster_pb2.DESCRIPTOR.services_by_name["Decode"], cluster_pb2_grpc.add_DecodeServicer_to_server),
    "main": (cluster_pb2.DESCRIPTOR.services_by_name["Decode"], cluster_pb2_grpc.add_DecodeServicer_to_server),
    "router": (router_pb2.DESCRIPTOR.services_by_name["Router"], router_pb2_grpc.add_RouterServicer_to_server),
}

SERVICE_NAMES = {
    "prefill": [cluster_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name],
    "relay": [cluster_pb2.DESCRIPTOR.services_by_name["Decode"].full_name],
    "main": [cluster_pb2.DESCRIPTOR.services_by_name["Decode"].full_name],
    "router": [router_pb2.DESCRIPTOR.services_by_name["Router"].full_name],
}


def model_meta(model: str):
    """(ModelConfig, tokenizer or None) without loading weights (for the router)."""
    from pddjax.model import gguf_loader
    from pddjax.model.config import NAMED_CONFIGS, TINY
    from pddjax.model.registry import smollm2_gguf_path
    from pddjax.model.tokenizer import GGUFTokenizer

    if model == "tiny":
        return TINY, None
    path = smollm2_gguf_path() if model in NAMED_CONFIGS else model
    reader = gguf_loader.open_reader(path)
    name = model if model in NAMED_CONFIGS else os.path.basename(path).removesuffix(".gguf")
    return gguf_loader.config_from_gguf(reader, name), GGUFTokenizer.from_reader(reader)


def build_servicer(cfg: ServiceConfig):
    """-> (servicer, add_to_server function)."""
    if cfg.role == "router":
        from serving.router.service import RouterService

        mcfg, tok = model_meta(cfg.model)
        return RouterService(cfg.router, mcfg, tok), router_pb2_grpc.add_RouterServicer_to_server
    from pddjax.model.jax_setup import configure

    configure(cfg.platform)
    import jax

    from pddjax.engines.paged_engine import EngineConfig, PagedEngine
    from pddjax.model.registry import load_model

    model = load_model(cfg.model)
    ecfg = EngineConfig(**cfg.engine)
    engine = PagedEngine(model.config, model.weights, model.fingerprint, ecfg)
    info = dict(role=rpc.ROLE_NAMES[cfg.role], model=model.config.name, fingerprint=model.fingerprint, dtype=ecfg.dtype,
                page_size=ecfg.page_size, num_pages=ecfg.num_pages, prefix_cache=ecfg.prefix_cache,
                num_layers=model.config.num_layers, num_kv_heads=model.config.num_kv_heads,
                head_dim=model.config.head_dim, platform=jax.default_backend(), attention=ecfg.attention)
    if cfg.role == "prefill":
        from serving.engine.prefill import PrefillService

        return PrefillService(engine, model.config, info), cluster_pb2_grpc.add_PrefillServicer_to_server
    from serving.engine.decode import DecodeService

    return DecodeService(cfg.role, engine, model.config, info), cluster_pb2_grpc.add_DecodeServicer_to_server


async def serve(cfg: ServiceConfig, ready_file: str | None = None) -> None:
    public = cfg.role == "router"  # the port users reach: bearer token, no reflection
    token = security.router_token() if public else None
    server = grpc.aio.server(options=rpc.SERVER_OPTIONS,
                             interceptors=[security.BearerAuth(token)] if token else None)
    names = SERVICE_NAMES[cfg.role]
    hs = rpc.add_health_and_reflection(server, names, reflection_on=not public)
    await rpc.set_serving(hs, names, False)  # the overall status "" starts SERVING in grpc's servicer
    metrics = ServiceMetrics(cfg.role)
    gate = Gate(metrics)
    descriptor, _ = ADD_TO_SERVER[cfg.role]
    register(server, descriptor, gate)
    port = rpc.add_port(server, f"{cfg.host}:{cfg.port}", public)
    if port == 0:
        raise OSError(f"cannot listen on {cfg.host}:{cfg.port}")
    await server.start()
    metrics_url = metrics.serve_http(cfg.host, 0)
    address = f"{cfg.host}:{port}"
    print(f"pddjax {cfg.role} loading on {address} (metrics {metrics_url})", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    servicer, _ = await loop.run_in_executor(None, build_servicer, cfg)
    servicer.start(loop)
    worker = getattr(servicer, "worker", None)
    if worker is not None:
        worker.metrics = metrics
    if hasattr(servicer, "attach_metrics"):
        servicer.attach_metrics(metrics)
    gate.ready(servicer)
    await rpc.set_serving(hs, names, True)
    if ready_file:
        tmp = ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"role": cfg.role, "pid": os.getpid(), "address": address, "metrics": metrics_url}, f)
        os.replace(tmp, ready_file)
    print(f"pddjax {cfg.role} serving on {address}", flush=True)
    await stop.wait()
    gate.drain()  # new RPCs: UNAVAILABLE; in-flight ones finish
    await rpc.set_serving(hs, names, False)
    await gate.wait_idle(DRAIN_SECONDS)
    await server.stop(grace=2)
    if worker is not None:
        worker.stop()
