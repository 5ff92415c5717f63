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

import collections

from pddjax.engines.buckets import row_bucket
from pddjax.engines.drafter import Drafter
from pddjax.engines.engine_api import TokenEvent

TRIMMED_PROBE_EVERY = 32  # a row whose drafts the cost rule keeps dropping still verifies one this often


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


class StepCosts:
    """Measured wall seconds of decode-only steps by the row count B of their member: the lower
    quartile of the last few. A first use's compile is one high outlier among them, and on a
    shared host other work only ever adds time: the median of the 4-row steps moved between 50
    and 80 ms within one `bench speculative` cell while the 8-row one stayed at 81-89, and the
    rule then kept drafts that widened 4 rows to 8 at a true ~1.7x."""

    def __init__(self, keep: int = 9):
        self.keep = keep
        self.samples: dict[int, collections.deque] = {}  # B -> recent step seconds

    def observe(self, rows: int, seconds: float) -> None:
        self.samples.setdefault(rows, collections.deque(maxlen=self.keep)).append(seconds)

    def get(self, rows: int) -> float | None:
        """The typical step of `rows` rows (padded to its bucket), None before one was measured."""
        got = self.samples.get(row_bucket(rows))
        return sorted(got)[len(got) // 4] if got else None


def worth_it(drafts: dict[int, list[int]], rows, costs: StepCosts | None) -> dict[int, list[int]]:
    """Keep the drafts that raise the step's expected tokens per second. Each draft is one more
    row, and a row's j-th draft yields a token only if the j before it were accepted (probability
    acceptance^j, the row's running acceptance). Rows of higher acceptance choose first, each the
    number of its drafts j that maximises (tokens expected + its gains) / cost(rows + j), with
    costs measured per row bucket; j = 0 when no j beats the step without them. A step size not
    measured yet keeps the drafts (so it gets measured). On a CPU a decode step of 2 rows costs
    up to twice one of 1 (matrix-vector vs matrix-matrix products), so a lone row drafts only
    while it copies well; a row dropped TRIMMED_PROBE_EVERY times in a row verifies one draft."""
    if costs is None or not drafts:
        return drafts
    n, expected, out = len(rows), float(len(rows)), {}
    for r in sorted(drafts, key=lambda r: -rows[r][0].drafter.acceptance):
        drafter = rows[r][0].drafter
        a = min(max(drafter.acceptance, 0.0), 0.999)
        now, keep, best, gains, gain = costs.get(n), 0, 0.0, 0.0, 1.0
        for j in range(1, len(drafts[r]) + 1):
            gain *= a
            gains += gain
            after = costs.get(n + j)
            if now is None or after is None:
                keep = len(drafts[r])
                break
            rate = (expected + gains) / after
            if rate > max(best, expected / now):
                keep, best = j, rate
        if not keep:
            drafter.trimmed += 1
            if drafter.trimmed < TRIMMED_PROBE_EVERY:
                continue
            keep = 1  # a probe, so a row that starts copying is seen
        drafter.trimmed = 0
        out[r] = drafts[r][:keep]
        n += keep
        expected += sum(a ** i for i in range(1, keep + 1))
    return out


def plan(rows, max_rows: int, max_step_tokens: int, spec_max_tokens: int,
         costs: StepCosts | None = None) -> dict[int, list[int]]:
    """Drafts for a step of `rows` [(Sequence, tokens)] -> {row index: drafts}; {} unless every
    row decodes its last token. Rows and tokens stay within the engine's limits (each draft is
    one more row); no row drafts past its max_tokens; with `costs`, only drafts that pay for
    their rows (`worth_it`)."""
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
    return worth_it(out, rows, costs)


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
