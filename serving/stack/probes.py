"""The fixed ports an orchestrator probes and scrapes (Kubernetes: deploy/).

In a pod a service's gRPC port is TLS (mutual on P, RLD and MD) and kubelet's native gRPC probe
speaks plaintext only; its /metrics endpoint listens on an ephemeral port unless told. So, from
the environment (a Deployment sets them per container; `pddjax up` leaves both unset):
- PDDJAX_HEALTH_PORT=N: a second, plaintext gRPC server on the service's host answering only
  grpc.health.v1, backed by the service port's own health servicer (NOT_SERVING while the model
  loads and compiles, and while draining). It carries no RPC of the service, so neither the TLS
  nor the per-role authorisation of the service port is weakened.
- PDDJAX_METRICS_PORT=N: the /metrics endpoint's port (default 0: any free one).
A value that is not a port number: UserError, one sentence.
"""

from __future__ import annotations

import os

import grpc
from grpc_health.v1 import health_pb2_grpc

from pddjax.errors import UserError

HEALTH_PORT_ENV = "PDDJAX_HEALTH_PORT"
METRICS_PORT_ENV = "PDDJAX_METRICS_PORT"


def env_port(name: str) -> int | None:
    """The port in environment variable `name`, or None when it is unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise UserError(f"{name} must be a port number from 1 to 65535, got {raw!r}")
    return int(raw)


def metrics_port() -> int:
    return env_port(METRICS_PORT_ENV) or 0


async def open_health_port(health_servicer, host: str) -> grpc.aio.Server | None:
    """A plaintext grpc.health.v1-only server on PDDJAX_HEALTH_PORT (None when unset)."""
    port = env_port(HEALTH_PORT_ENV)
    if port is None:
        return None
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot listen for health checks on {host}:{port}")
    await server.start()
    return server
