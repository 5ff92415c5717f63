"""Speculative decoding by prompt lookup, verified in the engine's own step (no jax here).

A step of decode rows only (every row one token, the sequence's last) may carry drafts: a row
whose sequence has a `Drafter` (engines/drafter.py) and a match gets k drafted tokens, and the
row becomes k + 1 one-token rows (`Position`s) at consecutive positions p .. p + k, each with
the sequence's page table: the last accepted token, then the drafts. Within each layer the step
writes every row's K/V before attention reads the pages (model/paged.py), so the row at p + j
attends to the drafts before it: k + 1 rows give the model's logits at every drafted position
in one forward, in the decode members of the stated shape set (T = B, Q = 1), so verification
adds no shape and no compile.

Each position samples its own output position with its own (seed, position) draw
(model/sampling.py), exactly what plain decoding would sample there given the same prefix.
`accept` records the sampled tokens in order while each equals the draft it follows: greedy
rows accept the longest prefix of drafts matching the model's argmax, then the model's next
token; sampled rows accept draft t exactly when the position's draw gives t (probability p(t)),
and on a rejection the token recorded is that draw conditioned on not being t (p with t
removed, renormalised): the standard rule for a point-mass draft, and token-identical to plain
decoding under the same seed. `Sequence.record` stops the run at a stop token or max_tokens
where plain decoding would. KV of rejected drafts is rolled back by setting the sequence's KV
length to the accepted tokens (pages are reserved whole at admission, so none change hands;
the radix cache only ever takes full pages below that length).
"""

from __future__ import annotations

from pddjax.engines.drafter import Drafter
from pddjax.engines.engine_api import TokenEvent


class _Pages:
    __slots__ = ("num_tokens",)

    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens


class Position:
    """One position of a drafted row, as `step_batch.build` / `sampling_arrays` read a Sequence:
    KV before it `pages.num_tokens`, its own token pending, output position len(generated)."""

    __slots__ = ("seq", "pages", "generated", "token", "page_array", "params", "matcher", "pen_row")

    def __init__(self, seq, start: int, out_pos: int, token: int):
        self.seq, self.pages, self.generated, self.token = seq, _Pages(start), range(out_pos), token
        self.page_array, self.params, self.matcher, self.pen_row = seq.page_array, seq.params, None, -1

    @property
    def num_tokens(self) -> int:
        return self.pages.num_tokens + 1

    def token_at(self, pos: int) -> int:
        return self.token

    def tokens_between(self, start: int, end: int) -> list[int]:
        return [self.token]


def can_draft(params) -> bool:
    """Rows that may speculate in this first pass: no penalties, logit bias, logprobs or grammar
    (their sampling state follows each recorded token; they decode one token a step, exactly)."""
    return not (params.penalised or params.logprobs or params.grammar is not None) and params.speculative


def new_drafter(seq, max_tokens: int) -> Drafter:
    return Drafter(seq.all_tokens(), max_tokens)


def plan(rows, max_rows: int, max_step_tokens: int, spec_max_tokens: int) -> dict[int, list[int]]:
    """Drafts for a step of `rows` [(Sequence, tokens)] -> {row index: drafts}; {} unless every
    row decodes its last token. Rows and tokens stay within the engine's limits (each draft is
    one more row); no row drafts past its max_tokens."""
    if any(n != 1 or seq.num_pending != 1 for seq, n in rows):
        return {}
    room = min(max_rows, max_step_tokens) - len(rows)
    out = {}
    for r, (seq, _) in enumerate(rows):
        limit = min(room, seq.max_tokens - len(seq.generated) - 1)
        if not seq.speculates or limit < 1:
            continue
        if seq.drafter is None:  # its context indexed once (P's one-token sequences never get here)
            seq.drafter = new_drafter(seq, spec_max_tokens)
        seq.drafter.sync_from(seq)
        drafts = seq.drafter.propose(limit)
        if drafts:
            out[r] = drafts
            room -= len(drafts)
    return out


def expand(rows, drafts: dict[int, list[int]]) -> tuple[list, list[int]]:
    """The step's rows with each drafted row as its k + 1 Positions -> (rows, each original
    row's first index among them)."""
    out, first = [], []
    for r, (seq, n) in enumerate(rows):
        first.append(len(out))
        if r not in drafts:
            out.append((seq, n))
            continue
        start, g = seq.pages.num_tokens, len(seq.generated)
        for j, t in enumerate([seq.token_at(start), *drafts[r]]):
            out.append((Position(seq, start + j, g + j, t), 1))
    return out, first


def accept(seq, drafts: list[int], tokens) -> tuple[list[TokenEvent], int]:
    """Record a drafted row's verified tokens (`tokens`: the sampled token of each of its k + 1
    positions) -> (their events, drafts accepted); its KV length set to what was accepted."""
    start, events, accepted = seq.pages.num_tokens, [], 0
    for j in range(len(drafts) + 1):
        t = int(tokens[j])
        pos = len(seq.generated)
        seq.record(t)
        events.append(TokenEvent(seq.seq_id, pos, t, seq.finish_reason))
        if seq.finish_reason or j == len(drafts) or t != drafts[j]:
            break
        accepted += 1
    seq.pages.num_tokens = start + 1 + accepted  # the rejected drafts' KV is forgotten
    seq.drafter.feedback(len(drafts), accepted)
    return events, accepted
