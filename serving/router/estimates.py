"""What the router has measured, for the auto policy (`choose`) and for `Stats`.

  - one `LinkEstimator` per MD address: the A -> B link's throughput and latency from completed
    KV transfers (P's TransferDone, background syncs too), plus the bytes queued on it now
    (booked when a push starts, settled when P reports it or the request is released);
  - one `Ewma` per RLD address: the decode speed of one request (tokens/s after its first
    batch), learnt when a request that streamed from RLD finishes.
Both start from the `[router]` priors until the first sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pddjax.policy import Ewma, LinkEstimator

if TYPE_CHECKING:
    from serving.config import RouterSettings
    from serving.router.pools import Instance


class Estimates:
    def __init__(self, settings: RouterSettings):
        self.wan_mbps_prior, self.wan_latency_s_prior = settings.wan_mbps_prior, settings.wan_latency_ms_prior / 1e3
        self.relay_tokens_per_s_prior = settings.rld_tokens_per_s_prior
        self.links: dict[str, LinkEstimator] = {}  # by MD address
        self.relay_speed: dict[str, Ewma] = {}  # by RLD address, tokens/s of one request

    def link(self, main: Instance) -> LinkEstimator:
        if main.address not in self.links:
            self.links[main.address] = LinkEstimator(self.wan_mbps_prior, self.wan_latency_s_prior)
        return self.links[main.address]

    def speed(self, relay: Instance) -> Ewma:
        return self.relay_speed.setdefault(relay.address, Ewma(self.relay_tokens_per_s_prior))

    def stats(self) -> dict:
        return {"links": {a: {"mbps": 8 * lk.throughput.value / 1e6, "latency_ms": 1e3 * lk.latency.value,
                              "queued_bytes": lk.queued, "samples": lk.throughput.samples}
                          for a, lk in self.links.items()},
                "rld_tokens_per_s": {a: e.value for a, e in self.relay_speed.items()}}
