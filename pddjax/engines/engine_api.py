"""The small interface the serving layer programs against (in the spirit of JetStream's
`engine_api`): `PagedEngine` implements it over JAX, `FakeEngine` by hand-checkable rules, so
the gRPC layers can be tested in milliseconds without a model. This module defines the types;
it imports no engine.

Contract:
  add(seq_id, prompt, params, max_tokens, stop_ids, hold_on_finish=, use_cache=) -> Sequence
  import_kv(seq_id, run: KVRun)                 KV computed elsewhere
  append_tokens(seq_id, start_pos, tokens)      output tokens produced elsewhere (handoff)
  step() -> list[TokenEvent]                    one packed step over every pending sequence
  export_kv(seq_id, start, end) -> KVRun        canonical KV out
  release(seq_id, cache=True)                   drop (insert into the prefix cache first)
  prefix_hit(prompt) -> int; prefix_hit_by_hashes(hashes) -> int; page_hashes(tokens)
  has_work() -> bool; check_integrity()
"""

from __future__ import annotations

import abc
import dataclasses


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the most likely alternatives, from the model's raw
    logits (log_softmax before temperature, penalties and bias)."""

    logprob: float  # of the sampled token
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first; top_logprobs of them


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One token a step sampled for one sequence (a step's rows that only computed KV emit none)."""

    seq_id: str
    position: int  # output position (0 = first generated token)
    token: int
    finish_reason: str | None  # "stop" | "length" on the sequence's last token, else None
    logprobs: TokenLogprobs | None = None  # when the request's SamplingParams.logprobs is on


class Engine(abc.ABC):
    fingerprint: str

    @abc.abstractmethod
    def add(self, seq_id, prompt, params, max_tokens, stop_ids=None, *, hold_on_finish=False, use_cache=True): ...

    @abc.abstractmethod
    def import_kv(self, seq_id, run) -> None: ...

    @abc.abstractmethod
    def append_tokens(self, seq_id, start_pos, tokens) -> None: ...

    @abc.abstractmethod
    def step(self) -> list[TokenEvent]: ...

    @abc.abstractmethod
    def export_kv(self, seq_id, start=0, end=None): ...

    @abc.abstractmethod
    def release(self, seq_id, cache=True) -> None: ...

    @abc.abstractmethod
    def prefix_hit(self, prompt) -> int: ...

    @abc.abstractmethod
    def has_work(self) -> bool: ...

    @abc.abstractmethod
    def check_integrity(self) -> None: ...
