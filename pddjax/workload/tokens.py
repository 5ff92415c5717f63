"""Deterministic token ids for a trace, so a real benchmark can replay it.

Rules (all ids uniform in [low, vocab_size), drawn with numpy's PCG64):

- doc `d` is `doc_tokens` ids from the stream seeded by (seed, 2, d): every session that
  starts from the same doc shares those ids, so prefix caches can hit across sessions;
- turn n's new tokens are `new_tokens` ids from the stream seeded by (context_seed, 3, n);
- turn 0's prompt = doc[:prefix_tokens] + new tokens;
- turn n's prompt = sequence(n-1)[:prefix_tokens] + new tokens, where
  sequence(n-1) = prompt(n-1) + output(n-1);
- output(n-1) is what the model really emitted, recorded with `record_output`; if nothing was
  recorded (e.g. offline analysis), synthetic ids from the stream (context_seed, 4, n-1) are used.

So turn n+1's prompt literally extends turn n's prompt + output whenever the turn is an
"append", and shares exactly `prefix_tokens` leading ids with it in every case.
"""

from __future__ import annotations

import numpy as np

from pddjax.workload.trace import TraceRequest


def _ids(seed: list[int], n: int, low: int, high: int) -> list[int]:
    return np.random.default_rng(seed).integers(low, high, size=n).tolist()  # [n]


class TokenBuilder:
    """Builds prompt token ids turn by turn; keeps each session's latest sequence."""

    def __init__(self, trace_seed: int, vocab_size: int, low: int = 16):
        if not 0 <= low < vocab_size:
            raise ValueError("need 0 <= low < vocab_size")
        self.trace_seed = trace_seed  # the WorkloadConfig seed (doc ids depend on it)
        self.vocab_size, self.low = vocab_size, low
        self._seq: dict[int, list[int]] = {}  # session_id -> prompt + output of latest turn
        self._turn: dict[int, int] = {}  # session_id -> latest turn built
        self._prompt_len: dict[int, int] = {}  # session_id -> prompt length of latest turn
        self._out_spec: dict[int, tuple[int, int]] = {}  # session_id -> (context_seed, output_tokens)

    def doc_ids(self, doc_id: int, n: int) -> list[int]:
        """The first `n` ids of shared doc `doc_id`."""
        return _ids([self.trace_seed, 2, doc_id], n, self.low, self.vocab_size)

    def prompt_ids(self, req: TraceRequest) -> list[int]:
        """Token ids of `req`'s prompt. Turns of a session must be built in order."""
        sid = req.session_id
        if req.turn == 0:
            source = self.doc_ids(req.doc_id, req.prefix_tokens)
        else:
            if self._turn.get(sid) != req.turn - 1:
                raise ValueError(f"{req.request_id}: build turn {req.turn - 1} of session {sid} first")
            if len(self._seq[sid]) == self._prompt_len[sid]:  # no output recorded
                self._fill_synthetic_output(sid, req.turn - 1)
            source = self._seq[sid]
            if req.prefix_tokens > len(source):
                raise ValueError(f"{req.request_id}: prefix longer than the previous sequence")
        new = _ids([req.context_seed, 3, req.turn], req.new_tokens, self.low, self.vocab_size)
        prompt = source[: req.prefix_tokens] + new
        self._seq[sid], self._turn[sid], self._prompt_len[sid] = list(prompt), req.turn, len(prompt)
        self._out_spec[sid] = (req.context_seed, req.output_tokens)
        return prompt

    def record_output(self, req: TraceRequest, output_ids: list[int]) -> None:
        """Append the ids `req` really produced, so the next turn extends them."""
        sid = req.session_id
        if self._turn.get(sid) != req.turn or len(self._seq[sid]) != self._prompt_len[sid]:
            raise ValueError(f"{req.request_id}: output recorded out of order")
        self._seq[sid].extend(int(t) for t in output_ids)

    def _fill_synthetic_output(self, sid: int, turn: int) -> None:
        seed, n = self._out_spec[sid]
        self._seq[sid].extend(_ids([seed, 4, turn], n, self.low, self.vocab_size))
