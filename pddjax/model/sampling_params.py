"""A request's sampling parameters and their validation, without a tensor library.

The router validates them on every Generate, so this module imports no JAX; the engines'
sampler (`sampling.py`, `penalties.py`) reads the same dataclass.

Bounds: presence and frequency penalty in [-2, 2] (OpenAI's), repetition penalty in (0, 2]
(1 = off; Hugging Face's rule, over prompt and output), at most 300 logit_bias entries of
distinct token ids, each bias in [-100, 100], top_logprobs in [0, 20]. NaN and infinities are
refused everywhere. `grammar`: a `pddjax.grammar.spec.GrammarSpec` (constrained decoding), its
form checked here; what llguidance refuses is refused when the engine's compiler builds it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from pddjax.grammar.spec import GrammarSpec

MAX_TEMPERATURE = 100.0  # far past any useful value; keeps logits / temperature finite
MAX_TOP_K = 2**31 - 1  # the engine's top-k array is int32 (0 = off; any k >= vocab keeps every token)
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|
MAX_REPETITION = 2.0  # repetition_penalty in (0, MAX_REPETITION]
MAX_LOGIT_BIAS = 300  # logit_bias entries
MAX_BIAS = 100.0  # |bias| of one entry
MAX_TOP_LOGPROBS = 20


def _pairs(bias) -> tuple:
    """logit_bias as a tuple of (id, bias) pairs sorted by id (a dict or list accepted); what it
    cannot sort or split is left for `validate` to refuse."""
    try:
        items = bias.items() if isinstance(bias, dict) else bias
        return tuple(sorted((tuple(p) for p in items), key=lambda p: p[0]))
    except (TypeError, ValueError, IndexError):
        return bias


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # <= 0 means greedy; at most MAX_TEMPERATURE
    top_k: int = 0  # 0 disables; at most MAX_TOP_K
    top_p: float = 1.0  # 1.0 disables; must be in (0, 1]
    seed: int = 0  # [0, 2^31)
    presence_penalty: float = 0.0  # subtracted once from every token generated so far
    frequency_penalty: float = 0.0  # subtracted per time a token was generated
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    logit_bias: tuple = ()  # ((token id, bias), ...) added to the logits; a dict is taken too
    logprobs: bool = False  # the sampled token's logprob (raw logits) on each token
    top_logprobs: int = 0  # and this many most likely alternatives (needs logprobs)
    grammar: GrammarSpec | None = None  # constrain the output to a JSON schema, regex or Lark grammar
    speculative: bool = True  # may draft (where the engine speculates: `[engine] speculative`); False opts out

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", _pairs(self.logit_bias))

    @property
    def penalised(self) -> bool:
        """Whether the sampler needs a state row (a penalty or a bias is in use)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises ValueError with one sentence on bad values (NaN and infinities included);
        logit_bias ids are checked against `vocab_size` when it is given."""
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:  # False for NaN
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top-k must be in [0, 2^31), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be true or false, got {self.speculative!r}")
        if not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must be in [0, 2^31), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        r = self.repetition_penalty
        if not _real(r) or not 0.0 < r <= MAX_REPETITION:
            raise ValueError(f"repetition_penalty must be a number in (0, {MAX_REPETITION:g}], got {r!r}")
        _check_bias(self.logit_bias, vocab_size)
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs must be true or false, got {self.logprobs!r}")
        n = self.top_logprobs
        if not _integer(n) or not 0 <= n <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {n!r}")
        if n and not self.logprobs:
            raise ValueError(f"top_logprobs {n} needs logprobs on")
        if self.grammar is not None:
            if not isinstance(self.grammar, GrammarSpec):
                raise ValueError(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")
            self.grammar.validate()


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_bias(bias, vocab_size: int | None) -> None:
    if not isinstance(bias, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in bias):
        raise ValueError(f"logit_bias must be (token id, bias) pairs or a mapping of them, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    seen = set()
    for tid, b in bias:
        if not _integer(tid) or tid < 0 or (vocab_size is not None and tid >= vocab_size):
            within = f"in [0, {vocab_size})" if vocab_size is not None else "(a non-negative integer)"
            raise ValueError(f"logit_bias token id {tid!r} is not a token id {within}")
        if tid in seen:
            raise ValueError(f"logit_bias names token id {tid} twice")
        seen.add(tid)
        if not _real(b) or not -MAX_BIAS <= b <= MAX_BIAS:
            raise ValueError(f"logit_bias of token {tid} must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {b!r}")


GREEDY = SamplingParams()  # the default: greedy, no filtering
