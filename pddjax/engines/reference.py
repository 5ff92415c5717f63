"""The monolithic reference engine: prefill, then one token at a time over a dense KV cache.

It is deliberately the simplest correct generation loop; every paged or disaggregated path
must reproduce its tokens exactly (and their logprobs, to float tolerance). Prefill lengths and
cache lengths are bucketed to powers of two so a steady workload reuses compiled code.
Penalties and logit_bias: the whole state is kept on the host as dense [V] arrays (counts of
generated tokens, prompt presence, bias) and passed with each token's call (`penalties.apply`,
the math the paged step runs); logprobs come from each token's raw logits. Constrained decoding
(`params.grammar`, compiled by the engine's `grammar` compiler): before each token its
matcher's packed mask is unpacked on the host by the numpy twin (`token_mask.allowed_np`) and
the disallowed logits set to -inf after penalties, before sampling; each token advances the
matcher, and a complete grammar ends the answer with "stop".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pddjax.engines.engine_api import TokenLogprobs
from pddjax.engines.executables import QUICK, compiler_options
from pddjax.model import penalties, token_mask
from pddjax.model import weights as wmod
from pddjax.model.config import ModelConfig
from pddjax.model.dense import DenseKV, forward_dense
from pddjax.model.sampling import logprobs as logprobs_of
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
    logprobs: list[TokenLogprobs] | None = None  # one per token when params.logprobs


def _sampling_arrays(p: SamplingParams, step: int):
    return (jnp.array([p.seed], jnp.int32), jnp.array([step], jnp.int32),
            jnp.array([p.temperature], jnp.float32), jnp.array([p.top_k], jnp.int32),
            jnp.array([p.top_p], jnp.float32))


def _penalised(logits, pen):
    # pen: None, or (counts [1, V] int32, seen [1, V] bool, bias [1, V] float32, presence,
    # frequency, repetition [1] float32)
    return logits if pen is None else penalties.apply(logits, *pen)


def _processed(logits, pen, allowed):
    # allowed: None, or bool [1, V] (the grammar's next tokens)
    x = _penalised(logits, pen)
    return x if allowed is None else jnp.where(allowed, x, -jnp.inf)


def _prefill(w, cfg: ModelConfig, tokens, length, cache):
    # tokens: [1, Tb] padded; length: [] valid tokens -> (raw logits of the last [1, V], cache)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    logits, cache = forward_dense(w, cfg, tokens, positions, cache, last_only=(length - 1).reshape(1))
    return logits[:, 0], cache


def _decode(w, cfg: ModelConfig, token, position, cache):
    # token: [1] last sampled id; position: [] its position -> (raw logits [1, V], cache)
    logits, cache = forward_dense(w, cfg, token[:, None], position.reshape(1, 1), cache)  # [1, 1, V]
    return logits[:, 0], cache


def _pick(last, seeds, steps, temp, top_k, top_p, greedy=False, pen=None, allowed=None):
    # last: [1, V] raw logits -> the token [1]. Apart from the forwards, so that one sampler
    # program serves every prompt and cache length
    return sample(_processed(last, pen, allowed), seeds, steps, temp, top_k, top_p, greedy_only=greedy)


_logprobs = jax.jit(logprobs_of)


class _Programs(NamedTuple):
    prefill: Callable
    decode: Callable
    pick: Callable


@functools.lru_cache(maxsize=2)
def _programs(quick: bool) -> _Programs:
    """The reference's jitted programs, compiled with XLA's defaults or `QUICK` (`compiler_options`)."""
    opts = dict(QUICK) if quick else None
    return _Programs(jax.jit(_prefill, static_argnames=("cfg",), donate_argnames=("cache",), compiler_options=opts),
                     jax.jit(_decode, static_argnames=("cfg",), donate_argnames=("cache",), compiler_options=opts),
                     jax.jit(_pick, static_argnames=("greedy",), compiler_options=opts))


class _HostPenalties:
    """A request's penalty state as dense host arrays: generated counts, prompt presence, bias."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab: int):
        self.counts = np.zeros(vocab, np.int32)  # [V]
        self.seen = np.zeros(vocab, bool)  # [V]
        self.seen[list(prompt_ids)] = True
        self.bias = np.zeros(vocab, np.float32)  # [V]
        for t, b in params.logit_bias:
            self.bias[t] = b
        self.scalars = tuple(np.array([v], np.float32) for v in
                             (params.presence_penalty, params.frequency_penalty, params.repetition_penalty))

    def arrays(self) -> tuple:
        return (self.counts[None], self.seen[None], self.bias[None], *self.scalars)


class ReferenceEngine:
    """Single-request generation; jitted prefill and decode with a donated dense cache."""

    def __init__(self, cfg: ModelConfig, weights: wmod.Weights, dtype=jnp.float32, grammar=None):
        self.cfg = cfg
        self.grammar = grammar  # a pddjax.grammar.compiler.GrammarCompiler (None: constrained requests refused)
        self.dtype = jnp.dtype(dtype)
        self.weights = wmod.cast(wmod.for_engine(weights, True), self.dtype)
        self.programs = _programs(compiler_options(cfg) is not None)

    def stream(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
               stop_ids: tuple[int, ...] | None = None, return_logits: bool = False, matcher=None) -> Iterator:
        """Yields generated token ids (or (id, raw logits [V]) pairs); stops after a stop id, a
        complete grammar or max_tokens. `matcher`: the grammar's to follow (default: a fresh one
        for params.grammar)."""
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
        pen = _HostPenalties(params, prompt_ids, cfg.vocab_size) if params.penalised else None
        if matcher is None and params.grammar is not None:
            if self.grammar is None:
                raise ValueError("constrained decoding needs the model's tokenizer: this engine has no grammar "
                                 "compiler")
            matcher = self.grammar.matcher(params.grammar)
        allowed = lambda: None if matcher is None else token_mask.allowed_np(matcher.mask(), cfg.vocab_size)[None]  # noqa: E731
        run = self.programs
        logits, cache = run.prefill(self.weights, cfg, jnp.asarray(tokens), jnp.int32(n), cache)
        tok = run.pick(logits, *_sampling_arrays(params, 0), greedy=greedy, pen=pen.arrays() if pen else None,
                       allowed=allowed())
        for step in range(max_tokens):
            t = int(tok[0])
            if matcher is not None:
                matcher.advance([t])
            yield (t, np.asarray(logits[0])) if return_logits else t
            if t in stop or step + 1 == max_tokens or (matcher is not None and matcher.is_finished()):
                return
            if pen is not None:
                pen.counts[t] += 1
            logits, cache = run.decode(self.weights, cfg, tok, jnp.int32(n + step), cache)
            tok = run.pick(logits, *_sampling_arrays(params, step + 1), greedy=greedy,
                           pen=pen.arrays() if pen else None, allowed=allowed())

    def generate(self, prompt_ids: list[int], params: SamplingParams = GREEDY, max_tokens: int = 16,
                 stop_ids: tuple[int, ...] | None = None) -> GenerationResult:
        """The whole answer; with params.logprobs, each token's logprob and top_logprobs alternatives."""
        out, lps = [], []
        matcher = self.grammar.matcher(params.grammar) if params.grammar is not None and self.grammar else None
        for t, logits in self.stream(prompt_ids, params, max_tokens, stop_ids, return_logits=True, matcher=matcher):
            out.append(t)
            if params.logprobs:
                chosen, ids, vals = jax.device_get(_logprobs(logits[None], np.asarray([t], np.int32)))
                k = params.top_logprobs
                lps.append(TokenLogprobs(float(chosen[0]), tuple(zip(ids[0, :k].tolist(), vals[0, :k].tolist()))))
        stop = set(self.cfg.eos_token_ids if stop_ids is None else stop_ids)
        reason = "stop" if out and (out[-1] in stop or (matcher is not None and matcher.is_finished())) else "length"
        return GenerationResult(list(prompt_ids), out, reason, lps if params.logprobs else None)
