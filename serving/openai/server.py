"""`pddjax serve openai --router HOST:PORT [--port N] [--model NAME]`: the gateway process.

Its own process (not inside the router): the router's event loop stays free of HTTP parsing
and JSON per chunk, the gateway scales or restarts on its own, and it is one more client of
the public Generate (the same token, TLS and deadlines as any other). uvicorn serves the
FastAPI app on one asyncio loop, which also carries the gRPC channel to the router. The
model's name and weights fingerprint (`system_fingerprint`) come from `--model` (what `pddjax
up` passes: the router's model): the fingerprint is the engines' (`tiny-seed0`, or the GGUF
file's sha256 prefix, read without JAX; "unknown" for a checkpoint directory). Once listening
it prints its base URL and writes the ready file (JSON {role, pid, address, url, metrics});
SIGTERM / SIGINT stop it (uvicorn's graceful shutdown: open streams get a few seconds).

Speed (issue 21's load target): uvicorn parses and writes with httptools (a declared
dependency; a C parser and chunked writer instead of h11): with app._Stream's plain sends, the
gateway's CPU per request fell ~25% (2.0-2.1 -> 1.6 ms) and per streamed token ~25-30%. uvloop
measured no clear gain on top (per request 1.7-1.95 ms, per round within noise), so the loop
stays asyncio's. Keep-alive connections stay open KEEPALIVE_S (uvicorn's default is 5 s): an
agent's next turn comes back after its think time, and a reopened connection is a handshake in
its TTFT.
"""

from __future__ import annotations

import asyncio
import json
import os

import uvicorn

from serving.openai.answer import Served
from serving.openai.app import Gateway, create_app
from serving.openai.upstream import Upstream

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


def write_ready(path: str, address: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"role": "openai", "pid": os.getpid(), "address": address, "url": f"http://{address}/v1",
                   "metrics": f"http://{address}/metrics"}, f)
    os.replace(tmp, path)


async def serve(router: str, host: str, port: int, model: str | None, ready_file: str | None = None,
                default_max_tokens: int = 256, request_timeout: float | None = 600.0) -> None:
    served, check = served_model(model)
    gw = Gateway(Upstream(router), served, check_model=check, default_max_tokens=default_max_tokens,
                 request_timeout=request_timeout)
    config = uvicorn.Config(create_app(gw), host=host, port=port, loop="asyncio", http="httptools",
                            log_level="warning", access_log=False, timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
                            timeout_keep_alive=KEEPALIVE_S)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # uvicorn could not start (e.g. the port is taken)
            raise OSError(f"cannot listen on {host}:{port}")
        await asyncio.sleep(0.05)
    bound = server.servers[0].sockets[0].getsockname()[1]
    address = f"{host}:{bound}"
    if ready_file:
        write_ready(ready_file, address)
    print(f"pddjax openai serving on http://{address}/v1 (router {router}, model {served.name})", flush=True)
    await task
