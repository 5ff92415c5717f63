"""Roofline timing of one serving instance (a group of chips holding one model replica).

Every forward pass takes max(FLOPs / F, bytes / BW) + overhead, with
    F  = chips * peak_flops * flop_eff       (flop_eff = 0.5: achieved / peak matmul rate)
    BW = chips * hbm_bw * bw_eff             (bw_eff = 0.8: achieved / peak HBM bandwidth)
and, for a pass over T new tokens whose attention covers P (query, key) pairs and reads the
KV of C cached tokens,
    FLOPs = 2 * active_params * T + 4 * layers * heads * head_dim * P
    bytes = param_bytes + kv_bytes_per_token * C.
Prefill of n new tokens after c cached ones: T = n, P = c*n + n^2/2, C = c + n (with sparse
attention of k keys per query, P = sum over queries of min(keys seen, k) and C, S capped).
A decode step of batch B with contexts summing to S: T = B, P = S, C = S; extend chunks
batched into the same step add their tokens, pairs and contexts.

Instance size: the smallest power-of-two chip count whose memory is at least twice the
weights (half of HBM left for KV, a common serving layout). KV capacity is 90% of memory
minus the weights. Parallelism across the chips is assumed perfect (no communication term).
"""

from __future__ import annotations

from dataclasses import dataclass

from pddjax.sim.hardware import Accelerator
from pddjax.sim.model import ModelProfile, attn_pairs

FLOP_EFF = 0.5
BW_EFF = 0.8
MEM_UTIL = 0.9
WEIGHT_FRACTION = 0.5


def chips_for(model: ModelProfile, acc: Accelerator, weight_fraction: float = WEIGHT_FRACTION) -> int:
    """Smallest power-of-two chip count with param_bytes <= weight_fraction * memory."""
    chips = 1
    while model.param_bytes > weight_fraction * chips * acc.mem_bytes:
        chips *= 2
    return chips


@dataclass(frozen=True)
class RooflineInstance:
    """Timing and capacity of one instance of `model` on `chips` x `acc`."""

    acc: Accelerator
    model: ModelProfile
    chips: int
    flop_eff: float = FLOP_EFF
    bw_eff: float = BW_EFF
    overhead_s: float = 0.0  # fixed cost per forward pass (launch, collectives); 0 = pure roofline

    @classmethod
    def build(cls, acc: Accelerator, model: ModelProfile, chips: int | None = None) -> RooflineInstance:
        return cls(acc=acc, model=model, chips=chips or chips_for(model, acc))

    @property
    def name(self) -> str:
        return f"{self.chips}x{self.acc.name}"

    @property
    def flops(self) -> float:
        return self.chips * self.acc.peak_flops * self.flop_eff

    @property
    def bw(self) -> float:
        return self.chips * self.acc.hbm_bw * self.bw_eff

    @property
    def cost_per_hour(self) -> float:
        return self.chips * self.acc.price_per_hour

    @property
    def kv_bytes_per_token(self) -> float:
        return self.model.kv_bytes_per_token

    @property
    def kv_capacity_tokens(self) -> int:
        free = self.chips * self.acc.mem_bytes * MEM_UTIL - self.model.param_bytes
        return max(0, int(free / self.model.kv_bytes_per_token))

    def _pass(self, tokens: float, pairs: float, kv_tokens: float) -> float:
        m = self.model
        flops = m.flops_per_token * tokens + m.attn_flops_per_pair * pairs
        nbytes = m.param_bytes + m.kv_bytes_per_token * kv_tokens
        return max(flops / self.flops, nbytes / self.bw) + self.overhead_s

    def prefill_s(self, new: int, cached: int) -> float:
        """Seconds to prefill `new` tokens after `cached` reused ones."""
        return self._pass(new, attn_pairs(self.model, cached, new), cached + new)

    def step_s(self, batch: int, ctx_sum: float, ext_tokens: int = 0, ext_ctx: float = 0,
               ext_pairs: float = 0) -> float:
        """Seconds for one forward: `batch` decode tokens over contexts summing to `ctx_sum`,
        plus `ext_tokens` extend-decode tokens (contexts `ext_ctx`, attention pairs `ext_pairs`)."""
        k = self.model.attn_keys
        if k is not None:  # each sequence reads / attends at most k cached tokens
            ctx_sum = min(ctx_sum, batch * k)
            ext_ctx = min(ext_ctx, ext_tokens * k)
            ext_pairs = min(ext_pairs, ext_tokens * k)
        return self._pass(batch + ext_tokens, ctx_sum + ext_pairs, ctx_sum + ext_ctx)
