"""The Decode service's `Probe` RPC: the far end of the router's link probe.

The router measures each MD's A -> B link before the first request needs it (at its start and
when an MD rejoins; `serving/router/estimates.py`): a few empty probes give the round trip, a
few payloads of up to 2 MiB the bandwidth, sent to MD's WAN address, the path P's KV takes. This
end does no work beyond counting what arrived: the payload is discarded and the answer is tiny,
so the time the router measures is the link's (the request's bytes cross A -> B, the answer's
few bytes B -> A), not MD's.

The payload is bounded here: a probe is small by design, and a service that accepted anything
up to the transport's limit (16 MiB, `serving.rpc.MAX_MESSAGE_BYTES`) could be made to soak its
own WAN with one call. A larger payload is refused with INVALID_ARGUMENT and one sentence.
Like every RPC it passes through the gate (`serving/gate.py`): refused while loading or
draining, malformed bytes -> INVALID_ARGUMENT, counted per method in the metrics. RLD serves
the same Decode service and answers probes alike (nothing probes it today).
"""

from __future__ import annotations

import grpc

from serving.pb import cluster_pb2

MAX_PAYLOAD_BYTES = 4 * 1024 * 1024  # twice the router's largest probe round


def refusal(nbytes: int) -> str | None:
    """The sentence a probe of `nbytes` is refused with, or None when it is within bounds."""
    if nbytes <= MAX_PAYLOAD_BYTES:
        return None
    return (f"a probe payload is at most {MAX_PAYLOAD_BYTES} bytes ({MAX_PAYLOAD_BYTES // (1024 * 1024)} MiB), "
            f"got {nbytes}: probe the link with smaller rounds")


async def probe(request: cluster_pb2.ProbeRequest, context) -> cluster_pb2.ProbeResponse:
    """Answers how many payload bytes arrived; refuses an oversized payload."""
    n = len(request.payload)
    why = refusal(n)
    if why is not None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
    return cluster_pb2.ProbeResponse(bytes_received=n)
