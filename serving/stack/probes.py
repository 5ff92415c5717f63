"""The fixed ports an orchestrator probes and scrapes (Kubernetes: deploy/).

In a pod a service's gRPC port is TLS (mutual on P, RLD and MD) and kubelet's native gRPC probe
speaks plaintext only; its /metrics endpoint listens on an ephemeral port unless told. So, from
the environment (a Deployment sets them per container; `pddjax up` leaves both unset):
- PDDJAX_HEALTH_PORT=N: a second, plaintext gRPC server on the service's host answering only
  grpc.health.v1, backed by the service port's own health servicer (NOT_SERVING while the model
  loads and compiles, and while draining). It carries no RPC of the service, so neither the TLS
  nor the per-role authorisation of the service port is weakened.
- PDDJAX_METRICS_PORT=N: the /metrics endpoint's port (default 0: any free one).
A value that is not a port number: UserError, one sentence (both read through pddjax.env).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2_grpc

from pddjax import env

HEALTH_PORT_ENV = env.HEALTH_PORT.name
METRICS_PORT_ENV = env.METRICS_PORT.name


def env_port(name: str) -> int | None:
    """The port in environment variable `name` (a port knob of pddjax.env), or None when unset."""
    return env.KNOBS[name].get()


def metrics_port() -> int:
    return env.METRICS_PORT.get() or 0


async def open_health_port(health_servicer, host: str) -> grpc.aio.Server | None:
    """A plaintext grpc.health.v1-only server on PDDJAX_HEALTH_PORT (None when unset)."""
    port = env.HEALTH_PORT.get()
    if port is None:
        return None
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot listen for health checks on {host}:{port}")
    await server.start()
    return server
