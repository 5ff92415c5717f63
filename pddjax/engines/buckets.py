"""Step shape buckets, plain Python (no jax; the simulator uses them): the per-dimension
buckets (T, B, MP, Q) and the stated set of shapes an engine runs (`bucket_set`), all built
before it serves, with `fit` / `fit_row` to pad a step into it. Nothing compiles on demand."""

from __future__ import annotations

from pddjax.sizes import pow2_at_least


def token_bucket(n: int) -> int:
    """T: packed tokens per step. Starts at 1: on CPU a 1-token step runs as matrix-vector
    products, measured 2x faster than the same step padded to 8 tokens."""
    return pow2_at_least(n, 1)


def row_bucket(n: int) -> int:  # B: rows per step
    return pow2_at_least(n, 1)


def pages_bucket(n: int) -> int:
    """MP: page-table width. Multiples of 8 up to 64, then powers of two: attention reads
    MP * page_size slots per row, so a power-of-two bucket alone could nearly double it."""
    if n <= 64:
        return max(8, -(-n // 8) * 8)
    return pow2_at_least(n, 64)


def q_len_bucket(n: int) -> int:  # max tokens of any row in the step
    return pow2_at_least(n, 1)


MIXED_PAD = 4  # a step with decode rows may pad its query block this much further (see pads_past)


def pads_past(members: list[Shape], limit: float, rows: int, tokens: int, width: int, q: int,
              decode_rows: bool) -> bool:
    """Would a step of `rows` rows (`tokens` packed, `width` pages in its widest row, `q` in its
    longest) pad its query block past the limit? The cheapest member holding it pads every row
    to Q: B x Q against `limit` x the step's tokens, and `limit` x MIXED_PAD with decode rows
    in it (their matmul rows are real, only attention pads): tail chunks of a few handoffs
    still ride with a few decodes (2 decodes + 3 extends of 22, joining one by one: 4 x 32 <=
    6 x 24, then 8 x 32 <= 6 x 68), while an extend chunk never pads a batch of decode rows to
    Q >= 16 (4 decodes + 1 of 16: 8 x 16 > 6 x 20; 64 decode rows padded to Q = 256 took 515 ms
    against 4.3 ms for the decodes alone, tiny model). A 5-token prompt and a 32-token chunk:
    2 x 32 > 1.5 x 37, each alone. A step of one-token rows, or limit 0: never. Steps that pass
    fit a member with T = B x Q."""
    if limit <= 0 or q <= 1:
        return False
    _, B, _, Q = fit(members, tokens, rows, width, q)
    return B * Q > limit * (MIXED_PAD if decode_rows else 1) * tokens


def step_order(pending: list, multi_first: bool) -> list:
    """The order rows join a step: fewest pending tokens first (decode rows, then short
    chunks); `multi_first` (the last step left a multi-token row out for padding): rows of
    several tokens first, so an extend chunk never waits behind decode rows for good."""
    if multi_first:
        return sorted(pending, key=lambda s: (s.num_pending == 1, s.num_pending))
    return sorted(pending, key=lambda s: s.num_pending)


# ---- the stated bucket set: every step shape an engine runs, compiled before it serves ----

Shape = tuple[int, int, int, int]  # (T tokens, B rows, MP page-table width, Q max row length)
MIN_CHUNK = 16  # the smallest step with a row of several tokens
MIN_WIDTH = 8  # the narrowest page table (pages)


def ladder(lo: int, hi: int, factor: int) -> list[int]:
    """lo, lo*factor, ... below hi, then hi itself (hi >= lo)."""
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= factor
    return out + [hi]


def max_width(config, model_config) -> int:
    """The widest page table a sequence can need: its context, at most the pool (page 0 scratch)."""
    pages = min(-(-model_config.max_context // config.page_size), config.num_pages - 1)
    return pow2_at_least(pages, MIN_WIDTH)


def bucket_set(config, model_config) -> list[Shape]:
    """Every (T, B, MP, Q) the engine of `config` (an EngineConfig) for `model_config` (a
    ModelConfig) runs, cheapest first; `PagedEngine.precompile()` builds them all before the
    service reports SERVING, and the scheduler only forms steps that fit one (`fit`).

    Tmax = pow2(max_step_tokens), Bmax = pow2(max_rows), Wmax = `max_width`; ladders x2
    unless said (each ends at its max):
    decode  every row one token: T = B in 1, 2, 4 .. Bmax; Q = 1; MP in 8, 16, 32 .. Wmax and the
            x1.5 steps from 64 on (96, 192, ...: `decode_widths`).
    chunk   one row of several tokens (a prefill chunk, a lone extend): B = 1, Q = T in
            16, 32 .. Tmax and the x1.5 steps from 128 on (192, 384: `chunk_tokens`); MP in
            32, 64 .. Wmax.
    mixed   several rows, one or more of several tokens (prompt rows sharing a step, extend /
            tail chunks of several handoffs, with or without decode rows), pad_limit > 0:
            B in 2, 4 .. Bmax, Q in 16, 32 .. with T = B x Q <= Tmax, MP as chunk: a step
            of several multi-token rows pads its query block B x Q to at most pad_limit x
            its tokens (`pads_past`), and these are the members such a step can take.
            pad_limit 0 (no limit): B in 4, 16 .. Bmax (x4), Q = T in 16, 64, 256 .. Tmax (x4).
    Why: decode is the hot path and pays for its page-table width on every step (the XLA
    gather copies B x MP pages per layer), so rows and widths keep the x2 ladders there;
    steps with a long row cost their T matmuls plus [B, Q] x [B, MP*S] attention, so a
    mixed step's Q is what its rows need, not T (measured on the tiny model, 64 rows: Q = T
    = 256 took 515 ms, Q = 16 15 ms, a decode step of 64 rows 4.3 ms).
    Greedy and sampled rows share every variant (the step picks its sampler at run time).
    Sizes: configs/tiny.toml 22; serving/default_stack.toml P and MD 130, RLD 104."""
    t_max, b_max = pow2_at_least(config.max_step_tokens), pow2_at_least(config.max_rows)
    w_max = max_width(config, model_config)
    widths = ladder(min(4 * MIN_WIDTH, w_max), w_max, 2)
    decode = [(b, b, w, 1) for b in ladder(1, b_max, 2) for w in decode_widths(w_max)]
    chunk = [] if t_max < 2 else [(t, 1, w, t) for t in chunk_tokens(t_max) for w in widths]
    if t_max < 2 or b_max < 2:
        mixed = []
    elif config.pad_limit > 0:
        mixed = [(b * q, b, w, q) for b in ladder(2, b_max, 2) for q in ladder(MIN_CHUNK, t_max, 2)
                 if b * q <= t_max for w in widths]
    else:
        mixed = [(t, b, w, t) for t in ladder(min(MIN_CHUNK, t_max), t_max, 4)
                 for b in ladder(min(4, b_max), b_max, 4) if b <= t for w in widths]
    return sorted(set(decode + chunk + mixed), key=lambda s: step_cost(s, config.page_size))


MID_WIDTH_FROM = 64  # decode widths from here on also get the x1.5 step between two of the x2 ladder
MID_CHUNK_FROM = 128  # and chunk lengths from here on


def chunk_tokens(t_max: int) -> list[int]:
    """The lengths (T = Q) of single-row chunk members: 16, 32, 64, ... t_max, and 192, 384, ...
    below t_max. A prompt's uncached tail pads to the next one: the real model's chunk at a
    900-token context ran 568.7 ms at 192 tokens against 756.6 at 256 (and 323.9 at 96 against
    381.9 at 128: too little to pay a member for; 2026-12-06), and after a cached prefix tails
    of any length are common."""
    return _with_mid_steps(ladder(min(MIN_CHUNK, t_max), t_max, 2), MID_CHUNK_FROM)


def decode_widths(w_max: int) -> list[int]:
    """The page-table widths of decode members: 8, 16, 32, 64, ... w_max, and 96, 192, 384, ...
    below w_max. A decode step gathers and attends over every slot of its width, so a row of
    65 pages at width 128 pays for 128: the real model's decode at a 1,100-token context ran
    309.6 / 131.9 ms at width 128 and 265.2 / 118.0 ms at 96 with 16 / 4 rows (2026-12-06).
    Below 64 pages the step is mostly its matmuls at the batch sizes that take such widths."""
    return _with_mid_steps(ladder(MIN_WIDTH, w_max, 2), MID_WIDTH_FROM)


def _with_mid_steps(x2: list[int], start: int) -> list[int]:
    """An x2 ladder (ending at its max) and, from `start` on, the x1.5 step after each rung below the max."""
    return sorted({*x2, *(v * 3 // 2 for v in x2 if v >= start and v * 3 // 2 < x2[-1])})


def covering_set(members: list[Shape]) -> list[Shape]:
    """The few members of a stated set that every step the scheduler forms can be packed into,
    cheapest first: at the widest page table, decode steps of 1, 2, 4 .. Bmax rows and the
    shortest and longest single-row chunk. Any row fits one of them alone (`fit_row`: the widest
    table holds any position), so a service can serve with these built and the rest still
    compiling (precompile.BackgroundBuild): steps pad further until their own members arrive,
    and a multi-token row that fits beside no decode row takes the next step (`pack_rows`)."""
    w_max = max(mp for _, _, mp, _ in members)
    decode = [m for m in members if m[3] == 1 and m[2] == w_max]
    chunks = sorted(m for m in members if m[1] == 1 and m[3] > 1 and m[2] == w_max)
    return [m for m in members if m in decode or m in chunks[:1] + chunks[-1:]]


def step_cost(shape: Shape, page_size: int) -> int:
    """A rough relative cost, to pick the cheapest covering member: the T matmuls, the
    [B, Q] x [B, MP*S] attention and the B x MP page gather (weights from measured steps)."""
    T, B, MP, Q = shape
    return 4096 * T + B * Q * MP * page_size + 8 * B * MP * page_size


def covers(shape: Shape, tokens: int, rows: int, width: int, q: int) -> bool:
    T, B, MP, Q = shape
    return tokens <= T and rows <= B and width <= MP and q <= Q


def fit(members: list[Shape], tokens: int, rows: int, width: int, q: int) -> Shape | None:
    """The cheapest member (members sorted by cost) holding a step of `tokens` packed tokens,
    `rows` rows, `width` pages in its widest row and `q` tokens in its longest; None if none."""
    for m in members:
        if covers(m, tokens, rows, width, q):
            return m
    return None


ALONE_PAD = 3.0  # a step's first row pads to at most this many times its tokens where a chunk member allows


def fit_row(members: list[Shape], tokens: int, rows: int, width: int, q: int, start: int, n: int,
            page_size: int) -> int:
    """The most tokens (<= n) of a row whose KV starts at `start` that can join a step of
    `tokens` / `rows` / `width` / `q` so far (rows = 0: the first row) and still fit a member;
    0 if none fits even one. A first row whose most tokens would pad past ALONE_PAD x them takes
    instead the most that a member of at least MIN_CHUNK tokens holds within that bound, if one
    does (on a covering set alone, a 64-token prompt runs as 16-token chunks rather than padded to
    256: on the real model at the widest table 4 x ~0.3 s against 7.3 s); later rows are judged
    with the whole step (`pads_past`)."""
    best, best_t, tight = 0, 0, 0
    for T, B, MP, Q in members:
        if B > rows and MP >= width and Q >= q:
            k = min(n, T - tokens, Q, MP * page_size - start)
            if k > best or k == best and T < best_t:
                best, best_t = k, T
            if k >= MIN_CHUNK and T <= ALONE_PAD * k:
                tight = max(tight, k)
            if best == n and (rows or best_t <= ALONE_PAD * n):  # the whole row fits: none can do better
                return n
    if rows == 0 and best_t > ALONE_PAD * best and tight:
        return tight
    return best


def pack_rows(members: list[Shape], pad_limit: float, pending: list, step_tokens: int, max_rows: int,
              multi_first: bool, page_size: int, start_of=lambda row: 0) -> tuple[list, bool]:
    """The rows of the next step, in `step_order`, each as many tokens as still fit a member
    (`fit_row`), stopping at the first row that fits none or would pad the step past
    `pad_limit` (`pads_past`) -> ([(row, tokens)], whether a multi-token row was left out: it
    goes first next step). `pending`: objects with `num_pending`; `start_of(row)`: the KV
    positions it already has (its page table width; the simulator has none: 0).
    PagedEngine.step and the simulator's P (pddjax/sim/engine_prefill.py) both step by this."""
    decode = _decode_step(members, pending, step_tokens, max_rows, page_size, start_of)
    if decode is not None:
        return decode, False
    return _pack_rows(members, pad_limit, pending, step_tokens, max_rows, multi_first, page_size, start_of)


def _decode_step(members: list[Shape], pending: list, step_tokens: int, max_rows: int, page_size: int,
                 start_of) -> list | None:
    """The rows of a step where every pending row decodes one token, in O(rows): the first
    min(max_rows, step_tokens) of them in arrival order, when one member holds them all (then it
    holds every prefix too, so `_pack_rows` would take the same rows); else None."""
    if not pending or any(row.num_pending != 1 for row in pending):
        return None
    take = pending[:min(max_rows, step_tokens)]
    width = max(-(-(start_of(row) + 1) // page_size) for row in take)  # pages the widest row needs
    if fit(members, len(take), len(take), width, 1) is None:
        return None
    return [(row, 1) for row in take]


def _pack_rows(members: list[Shape], pad_limit: float, pending: list, step_tokens: int, max_rows: int,
               multi_first: bool, page_size: int, start_of) -> tuple[list, bool]:
    """`pack_rows` row by row (any mix of decode rows, chunks and extends)."""
    rows, budget, packed, width, q = [], step_tokens, 0, 0, 0  # the step so far: tokens, widest table, longest row
    shortest = 0  # the fewest tokens of any row so far (1: the step has a decode row)
    for row in step_order(pending, multi_first):
        if len(rows) == max_rows or budget == 0:
            break
        start = start_of(row)
        n = fit_row(members, packed, len(rows), width, q, start, min(row.num_pending, budget), page_size)
        wider = max(width, -(-(start + n) // page_size))  # pages the step's widest row needs
        decode_rows = n == 1 or shortest == 1
        if n == 0 or (rows and pads_past(members, pad_limit, len(rows) + 1, packed + n, wider, max(q, n),
                                         decode_rows)):
            return rows, not multi_first and row.num_pending > 1
        rows.append((row, n))
        shortest = n if not shortest else min(shortest, n)
        budget, packed, q, width = budget - n, packed + n, max(q, n), wider
    return rows, False
