"""Token sampling whose random draw for output position t depends only on (seed, t).

So any engine that samples position t of a request draws the same token from the same
logits: this is what makes the RLD -> MD handoff exact. Greedy when temperature <= 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # <= 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1.0 disables; must be in (0, 1]
    seed: int = 0

    def validate(self) -> None:
        """Raises ValueError with one sentence on bad values."""
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.seed < 2**31):
            raise ValueError(f"seed must be in [0, 2^31), got {self.seed}")


def _sample_row(logits, seed, step, temperature, top_k, top_p):
    # logits: [V] float32; scalars per row
    V = logits.shape[-1]
    greedy = jnp.argmax(logits).astype(jnp.int32)
    t = jnp.maximum(temperature, 1e-6)
    scaled = logits / t
    order = jnp.argsort(-scaled)  # [V] descending
    sorted_logits = scaled[order]
    rank = jnp.arange(V)
    keep = jnp.where(top_k > 0, rank < top_k, True)  # [V]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    cum_before = jnp.cumsum(probs) - probs
    keep = keep & (cum_before < top_p)  # the top token is always kept
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
    choice = jax.random.categorical(key, masked)
    sampled = order[choice].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def sample(logits, seeds, steps, temperature, top_k, top_p):
    """logits: [B, V] float32; seeds, steps, top_k: [B] int32; temperature, top_p: [B] float32
    -> tokens [B] int32. `steps[b]` is the output position being sampled (0 = first token)."""
    return jax.vmap(_sample_row)(logits.astype(jnp.float32), seeds, steps, temperature, top_k, top_p)
