"""The fixed ports an orchestrator probes and scrapes (Kubernetes: deploy/).

In a pod a service's gRPC port is TLS (mutual on P, RLD and MD) and kubelet's native gRPC probe
speaks plaintext only; its /metrics endpoint listens on an ephemeral port unless told. So, from
the environment (a Deployment sets them per container; `pddjax up` leaves both unset):
- PDDJAX_HEALTH_PORT=N: a second, plaintext gRPC server on the service's host answering only
  grpc.health.v1, backed by the service port's own health servicer (NOT_SERVING while the model
  loads and compiles, and while draining). It carries no RPC of the service, so neither the TLS
  nor the per-role authorisation of the service port is weakened.
- PDDJAX_METRICS_PORT=N: the /metrics endpoint's port (default 0: any free one;
  its bounds: serving/metrics_http.py).
A value that is not a port number: UserError, one sentence (both read through pddjax.env).
The health port is bounded against whoever can reach it (`health_options`): a connection that sends
nothing is closed after HANDSHAKE_SECONDS, an idle one after IDLE_SECONDS, any one after
AGE_SECONDS; at most MAX_CONNECTIONS connections, MAX_RPCS RPCs and small metadata and messages.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2_grpc

from pddjax import env

HEALTH_PORT_ENV = env.HEALTH_PORT.name
METRICS_PORT_ENV = env.METRICS_PORT.name

HANDSHAKE_SECONDS = 5.0  # from connect to the client's HTTP/2 settings
IDLE_SECONDS = 30.0  # kubelet opens a connection per probe
AGE_SECONDS = 120.0
MAX_CONNECTIONS = 64
MAX_RPCS = 16
MAX_METADATA_BYTES = 8192
MAX_MESSAGE_BYTES = 4096  # a HealthCheckRequest is a service name


def health_options() -> list[tuple[str, int]]:
    """The health-only server's gRPC core options (read at call time)."""
    return [("grpc.server_handshake_timeout_ms", int(HANDSHAKE_SECONDS * 1000)),
            ("grpc.max_connection_idle_ms", int(IDLE_SECONDS * 1000)),
            ("grpc.max_connection_age_ms", int(AGE_SECONDS * 1000)),
            ("grpc.max_connection_age_grace_ms", int(HANDSHAKE_SECONDS * 1000)),
            ("grpc.max_allowed_incoming_connections", MAX_CONNECTIONS),
            ("grpc.max_concurrent_streams", MAX_RPCS),
            ("grpc.max_metadata_size", MAX_METADATA_BYTES),
            ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


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
    server = grpc.aio.server(options=health_options(), maximum_concurrent_rpcs=MAX_RPCS)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot listen for health checks on {host}:{port}")
    await server.start()
    return server
