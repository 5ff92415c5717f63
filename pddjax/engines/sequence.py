"""A running sequence's host-side state (no jax).

tokens = prompt + generated; KV exists for tokens[:pages.num_tokens]; the rest is pending and
goes into the next step as one row (prefill chunk, extend, or single-token decode). Output
position t is generated[t]: the first token (sampled after the prompt) is position 0.
`generated` changes only through record / append_known / rollback (the penalty row follows it;
so does a constrained sequence's grammar matcher, which has consumed exactly `generated`: each
token is advanced through as it is recorded or appended, a token the grammar refuses is a
ValueError before anything is appended, and the sequence finishes with "stop" once the grammar
is complete, `Matcher.is_finished`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pddjax.kv.page_table import SequencePages
from pddjax.model.sampling_params import SamplingParams


@dataclasses.dataclass
class Sequence:
    seq_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    pages: SequencePages
    generated: list[int] = dataclasses.field(default_factory=list)
    prefix_node: object | None = None  # locked radix path of the cached prefix
    hold_on_finish: bool = False  # keep pages after finishing (P holds KV until exported)
    finish_reason: str | None = None  # "stop" | "length" once finished
    num_sampled_here: int = 0  # tokens this engine sampled (vs. appended from elsewhere)
    paused: bool = False  # not stepped while set (serving: KV or a handoff still in transit)
    table_width: int = 0  # page_array's length at least (the engine's widest page table)
    pen_row: int = -1  # the engine's penalty table row (-1: none; engines/penalty_state.py)
    pen_counted: int = -1  # generated tokens that row holds (-1: to be seeded in full)
    matcher: object | None = None  # the grammar's pddjax.grammar.matcher.Matcher (None: unconstrained)
    speculates: bool = False  # may draft (engines/speculate.py)
    drafter: object | None = None  # its engines.drafter.Drafter, made at its first decode step
    page_array: np.ndarray = dataclasses.field(init=False, repr=False)  # [max(width, pages)] int32, page 0 padded

    def __post_init__(self):
        # a sequence's pages are reserved whole at admission (prompt + max_tokens) and never change
        pages = self.pages.pages
        self.page_array = np.zeros(max(self.table_width, len(pages)), np.int32)
        self.page_array[:len(pages)] = pages

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    def token_at(self, pos: int) -> int:
        n = len(self.prompt)
        return self.prompt[pos] if pos < n else self.generated[pos - n]

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) (prompt, then generated)."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        if start >= n:
            return self.generated[start - n:end - n]
        return self.prompt[start:] + self.generated[:end - n]

    def all_tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not computed yet (0 once finished: the last sample is never fed back)."""
        return 0 if self.finish_reason or self.paused else self.num_tokens - self.pages.num_tokens

    def record(self, token: int) -> None:
        """A token sampled by this engine at output position len(generated)."""
        if self.matcher is not None:
            self.matcher.advance([token])
        self.generated.append(token)
        self.num_sampled_here += 1
        self._check_finished()

    def append_known(self, start_pos: int, tokens: list[int]) -> None:
        """Tokens produced elsewhere (RLD handoff) at output positions start_pos...

        Overlap with tokens already here must agree (same seed, same position, same token); the
        new ones must be what the grammar allows, if there is one (on a refused token, none is kept)."""
        if start_pos > len(self.generated):
            raise ValueError(f"handoff for {self.seq_id} starts at output position {start_pos} "
                             f"but only {len(self.generated)} tokens are known")
        base = len(self.generated)
        for i, t in enumerate(tokens):
            p = start_pos + i
            if p < len(self.generated):
                if self.generated[p] != t:
                    raise ValueError(f"handoff for {self.seq_id} disagrees at output position {p}: "
                                     f"{t} vs {self.generated[p]}")
            else:
                if self.matcher is not None:
                    try:
                        self.matcher.advance([t])
                    except ValueError:
                        self.rollback(base)
                        raise
                self.generated.append(t)
                if self._check_finished():
                    return

    def rollback(self, num_generated: int) -> None:
        """Forget output tokens from position num_generated on (a handoff from another tier
        disagrees with tokens sampled here); their KV is recomputed on the next step."""
        if num_generated < len(self.generated):
            if self.matcher is not None:
                self.matcher.rollback(len(self.generated) - num_generated)
            self.generated = self.generated[:num_generated]
            if self.drafter is not None:
                self.drafter.truncate(len(self.prompt) + num_generated)
            if self.pen_counted > num_generated:  # the penalty row counted tokens now gone
                self.pen_counted = -1
            self.pages.num_tokens = min(self.pages.num_tokens, len(self.prompt) + num_generated)
            self.finish_reason = None

    def _check_finished(self) -> bool:
        if self.generated and self.generated[-1] in self.stop_ids:
            self.finish_reason = "stop"
        elif self.matcher is not None and self.matcher.is_finished():
            self.finish_reason = "stop"
        elif len(self.generated) >= self.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None
