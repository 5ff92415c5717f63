"""The A -> B link of `pddjax up` and `pddjax bench serve`: a thin adapter over the WAN
emulator (`pddjax.wan.emulator.WanEmulator`), keeping the small interface the stack uses.

Both directions are shaped alike (bandwidth, one-way latency, jitter, bandwidth trace, stalls);
bytes are counted each way. `mbps` and `latency_ms` can be changed while running (tests slow
the link between requests); the emulator keeps its byte counters and queue across changes.
The token bucket defaults to 1 byte (pure rate, no burst), the old link's behaviour; pass
`burst_bytes` for a real bucket.
"""

from __future__ import annotations

import dataclasses

from pddjax.wan.emulator import A_TO_B, B_TO_A, WanEmulator
from pddjax.wan.shaping import LinkProfile


class WanLink:
    def __init__(self, target_host: str, target_port: int, mbps: float = 0.0, latency_ms: float = 0.0, *,
                 jitter_ms: float = 0.0, jitter_dist: str = "normal", trace: list | None = None,
                 stalls: list | None = None, burst_bytes: int = 1, seed: int = 0):
        profile = LinkProfile(mbps=float(mbps), latency_ms=float(latency_ms), jitter_ms=float(jitter_ms),
                              jitter_dist=jitter_dist, burst_bytes=int(burst_bytes),
                              trace=[(float(t), float(m)) for t, m in (trace or [])],
                              stalls=[(float(s), float(d)) for s, d in (stalls or [])], seed=int(seed))
        profile.validate()
        self.target = (target_host, int(target_port))
        self.emulator = WanEmulator(f"{target_host}:{target_port}", profile, dataclasses.replace(profile))

    @classmethod
    def from_settings(cls, target: str, wan: dict) -> WanLink:
        """From a stack config's `[wan]` table: mbps, latency_ms, jitter_ms, jitter_dist, trace
        ([[t_s, mbps], ...]), stalls ([[start_s, dur_s], ...]), burst_bytes, seed."""
        host, port = target.rsplit(":", 1)
        known = {"mbps", "latency_ms", "jitter_ms", "jitter_dist", "trace", "stalls", "burst_bytes", "seed"}
        return cls(host, int(port), **{k: v for k, v in wan.items() if k in known})

    # ---- the interface up.py and the tests use ---------------------------------------
    @property
    def mbps(self) -> float:
        return self.emulator.profile.mbps

    @mbps.setter
    def mbps(self, value: float) -> None:
        self._set(mbps=float(value))

    @property
    def latency_ms(self) -> float:
        return self.emulator.profile.latency_ms

    @latency_ms.setter
    def latency_ms(self, value: float) -> None:
        self._set(latency_ms=float(value))

    @property
    def bytes_a_to_b(self) -> int:  # client -> target (the KV and handoff direction)
        return self.emulator.wires[A_TO_B].bytes

    @property
    def bytes_b_to_a(self) -> int:
        return self.emulator.wires[B_TO_A].bytes

    @property
    def connections(self) -> int:
        return self.emulator.connections

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        return await self.emulator.start(host, port)

    async def close(self) -> None:
        await self.emulator.close()

    def stats(self) -> dict:
        p = self.emulator.profile
        return {"mbps": p.mbps, "latency_ms": p.latency_ms, "jitter_ms": p.jitter_ms, "jitter_dist": p.jitter_dist,
                "trace_steps": len(p.trace), "stalls": len(p.stalls), "bytes_a_to_b": self.bytes_a_to_b,
                "bytes_b_to_a": self.bytes_b_to_a, "connections": self.connections}

    def _set(self, **change) -> None:
        self.emulator.set_profile(dataclasses.replace(self.emulator.profile, **change))
