"""The monolithic reference engine: prefill, then one token at a time over a dense KV cache.

It is deliberately the simplest correct generation loop; every paged or disaggregated path
must reproduce its tokens exactly. Prefill lengths and cache lengths are bucketed to powers of
two so a steady workload reuses compiled code.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from pddjax.model import weights as wmod
from pddjax.model.config import ModelConfig
from pddjax.model.dense import DenseKV, forward_dense
from pddjax.model.sampling import sample
from pddjax.model.sampling_params import GREEDY, SamplingParams
from pddjax.sizes import pow2_at_least


def bucket(n: int) -> int:
    """A dense cache's length: the smallest power of two >= max(n, 16)."""
    return pow2_at_least(n, 16)


@dataclasses.dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop token) | "length"


def _sampling_arrays(p: SamplingParams, step: int):
    return (jnp.array([p.seed], jnp.int32), jnp.array([step], jnp.int32),
            jnp.array([p.temperature], jnp.float32), jnp.array([p.top_k], jnp.int32),
            jnp.array([p.top_p], jnp.float32))


@functools.partial(jax.jit, static_argnames=("cfg", "greedy"), donate_argnames=("cache",))
def _prefill(w, cfg: ModelConfig, tokens, length, cache, seeds, steps, temp, top_k, top_p, greedy=False):
    # tokens: [1, Tb] padded; length: [] valid tokens -> (first token [1], cache)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    logits, cache = forward_dense(w, cfg, tokens, positions, cache, last_only=(length - 1).reshape(1))
    last = logits[:, 0]  # [1, V]
    return sample(last, seeds, steps, temp, top_k, top_p, greedy_only=greedy), last, cache


@functools.partial(jax.jit, static_argnames=("cfg", "greedy"), donate_argnames=("cache",))
def _decode(w, cfg: ModelConfig, token, position, cache, seeds, steps, temp, top_k, top_p, greedy=False):
    # token: [1] last sampled id; position: [] its position -> (next token [1], cache)
    logits, cache = forward_dense(w, cfg, token[:, None], position.reshape(1, 1), cache)  # [1, 1, V]
    return sample(logits[:, 0], seeds, steps, temp, top_k, top_p, greedy_only=greedy), logits[:, 0], cache


class ReferenceEngine:
    """Single-request generation; jitted prefill and decode with a donated dense cache."""

    def __init__(self, cfg: ModelConfig, weights: wmod.Weights, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.weights = wmod.cast(weights, self.dtype)

    def stream(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
               stop_ids: tuple[int, ...] | None = None, return_logits: bool = False) -> Iterator:
        """Yields generated token ids (or (id, logits [V]) pairs); stops after a stop id or max_tokens."""
        cfg = self.cfg
        stop = set(cfg.eos_token_ids if stop_ids is None else stop_ids)
        n = len(prompt_ids)
        if n < 1 or n + max_tokens > cfg.max_context:
            raise ValueError(f"prompt of {n} tokens plus {max_tokens} new ones does not fit the context of "
                             f"{cfg.max_context}")
        tb = bucket(n)
        cache = DenseKV.zeros(cfg, 1, min(bucket(n + max_tokens), bucket(cfg.max_context)), self.dtype)
        if cache.k.shape[2] < tb:  # prefill pad must fit the cache
            cache = DenseKV.zeros(cfg, 1, tb, self.dtype)
        greedy = params.temperature <= 0
        tokens = np.zeros((1, tb), np.int32)
        tokens[0, :n] = prompt_ids
        tok, logits, cache = _prefill(self.weights, cfg, jnp.asarray(tokens), jnp.int32(n), cache,
                                      *_sampling_arrays(params, 0), greedy=greedy)
        for step in range(max_tokens):
            t = int(tok[0])
            yield (t, np.asarray(logits[0])) if return_logits else t
            if t in stop or step + 1 == max_tokens:
                return
            tok, logits, cache = _decode(self.weights, cfg, tok, jnp.int32(n + step), cache,
                                         *_sampling_arrays(params, step + 1), greedy=greedy)

    def generate(self, prompt_ids: list[int], params: SamplingParams = GREEDY, max_tokens: int = 16,
                 stop_ids: tuple[int, ...] | None = None) -> GenerationResult:
        out = list(self.stream(prompt_ids, params, max_tokens, stop_ids))
        stop = set(self.cfg.eos_token_ids if stop_ids is None else stop_ids)
        reason = "stop" if out and out[-1] in stop else "length"
        return GenerationResult(list(prompt_ids), out, reason)
