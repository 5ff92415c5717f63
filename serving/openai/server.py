"""uvicorn serving the gateway (app.py): in the router's process (`pddjax serve router
--openai-port N`, what `pddjax up` runs: `start_cohosted`) or alone in front of a router on
another host (`pddjax serve openai --router HOST:PORT [--port N] [--model NAME]`: `serve`).

Why in the router's process (issue 21; it was its own process until session 8): on a small
machine the gateway's CPU competes with the engines and the router, and a separate gateway pays
for every streamed token twice: the router serializes and writes a gRPC message, the gateway
reads and parses it (py-spy, separate gateway under 64 streams: gRPC receive 22% of its busy
time, the HTTP write 22%, pydantic chunks 11%, anyio 10%, starlette 8%, SSE framing 7%; ~0.4-0.5
s CPU per 64 x 32-token round on top of the router's). Co-hosted, the gateway calls the router's
entry point in memory (serving/stack/cohost.RouterUpstream: the same bearer token check, Gate
(loading / draining 503), deadlines and statuses as the gRPC port), so the router writes no gRPC
message per token and the gateway reads none: the router process's CPU in a gateway round is
about its CPU in a direct gRPC round (0.30-0.48 vs 0.25-0.56 s per round; a separate gateway
added 0.32-0.57 s of its own), and `python -m tools.hostlab.openai_overhead --rounds 4`'s TTFT /
ITL p50 ratios went from 1.12 / 1.64 to 0.87 / 0.93 on a quiet machine (medians of 10 loaded
pairs: 1.21 / 1.16 to 1.02 / 1.00; docs/figures.md, "OpenAI gateway"). The cost: the
router's loop also parses HTTP and writes one SSE event per chunk (~0.6 ms per request + ~35 us
per token against a stand-in router), and the gateway restarts with the router; a gateway on
another host (or several, for spare cores) is still `serve openai --router`. The router process
loads no JAX.

One asyncio loop carries uvicorn and the upstream (the router's own loop, co-hosted; a gRPC
channel otherwise). The model's name and weights fingerprint (`system_fingerprint`) come from
the router's model (co-hosted) or `--model` (alone): the fingerprint is the engines'
(`tiny-seed0`, or the GGUF file's sha256 prefix, read without JAX; "unknown" for a checkpoint
directory). Alone, once listening it prints its base URL and writes the ready file (JSON {role,
pid, address, url, metrics}); SIGTERM / SIGINT stop it (uvicorn's graceful shutdown: open
streams get a few seconds). Co-hosted, the router's ready file names it (`openai`: {address,
url, metrics}); the router's drain lets its requests finish, then stops it (`Cohosted.stop`).

Edge: connections, request heads and bodies are bounded (edge.py: uvicorn runs EdgeProtocol,
httptools with a connection limit, a head size and time bound); the port serves HTTPS when given
a certificate and key (`https`: uvicorn's ssl_certfile / ssl_keyfile), and in plaintext off
loopback only as the router's own port may (`plaintext_problem`). The gateway's metrics are not
on this port: co-hosted they join the router's registry (its metrics endpoint), alone they get a
metrics endpoint of their own (PDDJAX_METRICS_PORT, else any free port, on the gateway's host).

Speed: uvicorn parses and writes with httptools (a declared dependency; a C parser and chunked
writer instead of h11): the gateway's CPU per request fell ~25% (2.0-2.1 -> 1.6 ms) and per
streamed token ~25-30%. uvloop measured no clear gain on top (per request 1.7-1.95 ms, per round
within noise), so the loop stays asyncio's (co-hosted it is the router's anyway). Keep-alive
connections stay open KEEPALIVE_S (uvicorn's default is 5 s): an agent's next turn comes back
after its think time, and a reopened connection is a handshake in its TTFT.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os

import uvicorn

from pddjax import env
from pddjax.addresses import is_loopback
from serving import security
from serving.metrics_http import MetricsEndpoint
from serving.openai.answer import Served
from serving.openai.app import Gateway, create_app
from serving.openai.edge import EdgeProtocol
from serving.openai.metrics import GatewayMetrics
from serving.openai.upstream import GrpcUpstream
from serving.openai.upstream_api import Upstream

SHUTDOWN_GRACE_S = 5
KEEPALIVE_S = 75  # as nginx's keepalive_timeout


def served_model(name: str | None) -> tuple[Served, bool]:
    """(the model as responses name it, whether requests must name it). No name: "pddjax", any accepted."""
    if not name:
        return Served("pddjax", "unknown"), False
    if name == "tiny":
        return Served("tiny", "tiny-seed0"), True  # registry.load_model("tiny") uses seed 0
    from pddjax.model import meta
    from pddjax.model.gguf_meta import file_fingerprint

    try:
        kind, path, model = meta.model_source(name)
    except meta.ModelNotFound:
        return Served(name, "unknown"), True
    return Served(model, file_fingerprint(path) if kind == "gguf" else "unknown"), True


class _Server(uvicorn.Server):
    """uvicorn on a loop it shares (the router's): the host process keeps its own signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _listen(gw: Gateway, host: str, port: int, server_class=uvicorn.Server, **config):
    """uvicorn serving the gateway's app on this loop -> (server, its task, "host:port" bound)."""
    config = uvicorn.Config(create_app(gw), host=host, port=port, loop="asyncio", http=EdgeProtocol, ws="none",
                            log_level="warning", access_log=False, timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
                            timeout_keep_alive=KEEPALIVE_S, **config)
    server = server_class(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # uvicorn could not start (e.g. the port is taken)
            raise OSError(f"cannot listen on {host}:{port}")
        await asyncio.sleep(0.05)
    return server, task, f"{host}:{server.servers[0].sockets[0].getsockname()[1]}"


def urls(address: str, metrics: str, https: bool = False) -> dict:
    return {"address": address, "url": f"{'https' if https else 'http'}://{address}/v1", "metrics": metrics}


def plaintext_problem(host: str, insecure: bool, token: bool, https: bool = False) -> str | None:
    """The router port's rule (security.listen_problem) on the HTTP side: off loopback, plaintext
    only with `insecure`, and never when requests carry the router's bearer token (the API key).
    `token`: the router requires one (a gateway alone forwards each caller's Authorization and
    cannot know the router takes none: it passes True)."""
    if https or is_loopback(host):
        return None
    where = host or "every interface"
    if token:
        return (f"refusing to serve the OpenAI gateway in plaintext on {where}: its requests carry the router's "
                "bearer token; give it a certificate (--https-cert / --https-key) or listen on a loopback address "
                "behind a TLS proxy")
    if not insecure:
        return (f"refusing to serve the OpenAI gateway in plaintext on {where}: give it a certificate "
                "(--https-cert / --https-key), listen on a loopback address behind a TLS proxy, or pass --insecure")
    return None


def https_config(cert: str | None, key: str | None) -> dict:
    """uvicorn's TLS settings for (certificate chain, key) PEM files; {} for plaintext."""
    if bool(cert) != bool(key):
        raise security.SecurityConfigError("the gateway's HTTPS needs both --https-cert and --https-key")
    for path in filter(None, (cert, key)):
        if not os.path.isfile(path):
            raise security.SecurityConfigError(f"cannot read the gateway's HTTPS file {path}")
    return {"ssl_certfile": cert, "ssl_keyfile": key} if cert else {}


def write_ready(path: str, info: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"role": "openai", "pid": os.getpid(), **info}, f)
    os.replace(tmp, path)


async def serve(router: str, host: str, port: int, model: str | None, ready_file: str | None = None,
                default_max_tokens: int = 256, request_timeout: float | None = 600.0,
                https: dict | None = None) -> None:
    """A gateway process in front of the router at `router` (over gRPC); `https`: https_config's."""
    served, check = served_model(model)
    gw = Gateway(GrpcUpstream(router), served, check_model=check, default_max_tokens=default_max_tokens,
                 request_timeout=request_timeout, cache_hits=env.OPENAI_CACHE_HITS.get())
    metrics = MetricsEndpoint(gw.metrics.registry, host, env.METRICS_PORT.get() or 0)
    server, task, address = await _listen(gw, host, port, **(https or {}))
    info = urls(address, f"http://{host}:{metrics.port}/metrics", bool(https))
    if ready_file:
        write_ready(ready_file, info)
    print(f"pddjax openai serving on {info['url']} (router {router}, model {served.name})", flush=True)
    await task


@dataclasses.dataclass
class Cohosted:
    """The gateway on the router's loop (`pddjax serve router --openai-port N`)."""

    server: uvicorn.Server
    task: asyncio.Task
    gateway: Gateway
    address: str
    info: dict  # urls(): address, url, metrics (the router's endpoint)

    async def stop(self, drain_s: float) -> None:
        """After the router's Gate drains: the gateway's requests finish (up to drain_s), then uvicorn stops."""
        await self.gateway.wait_idle(drain_s)
        self.server.should_exit = True
        await self.task


async def start_cohosted(upstream: Upstream, host: str, port: int, model: str | None, default_max_tokens: int = 256,
                         request_timeout: float | None = 600.0, *, https: dict | None = None, registry=None,
                         metrics_url: str = "") -> Cohosted:
    """The gateway's HTTP port opened on this (the host process's) loop in front of `upstream`
    (the router in this process: serving/stack/cohost.py); the host keeps its signal handlers.
    `registry` / `metrics_url`: the host's metrics (the gateway's join them); `https`: https_config's."""
    served, check = served_model(model)
    gw = Gateway(upstream, served, check_model=check, default_max_tokens=default_max_tokens,
                 request_timeout=request_timeout, metrics=GatewayMetrics(registry),
                 cache_hits=env.OPENAI_CACHE_HITS.get())
    server, task, address = await _listen(gw, host, port, _Server, log_config=None, **(https or {}))
    return Cohosted(server, task, gw, address, urls(address, metrics_url, bool(https)))
