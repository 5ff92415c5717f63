"""The host arrays of one engine step, numpy (no jax call): the packed batch of its rows and their
sampling arrays, in the dtypes `precompile.dummy_batch` builds the step with.

rows: [(Sequence, tokens this step)], in step order; shape: the member (T, B, MP, Q) the step
pads to. The jitted step takes the arrays as they are (jax's C++ dispatch transfers them).
"""

from __future__ import annotations

import numpy as np

from pddjax.kv.allocator import NULL_PAGE
from pddjax.model.paged import PackedBatch


def build(rows, shape: tuple[int, int, int, int], page_size: int) -> tuple[PackedBatch, list[bool], bool]:
    """-> (PackedBatch of numpy arrays, which rows sample a token, whether every sampling row is
    greedy). No `jnp.asarray` per array: in JAX 0.10 each converts through a staged program,
    traced, lowered and compiled per shape on first use (and again after `jax.clear_caches`).
    Python gathers the rows' scalars and token ids (list comprehensions); page tables,
    positions, KV slots, row offsets and lengths are whole-array numpy. Fresh arrays every
    step, not reused buffers: on CPU the step may read a numpy buffer in place while it runs
    asynchronously."""
    S = page_size
    T, B, MP, _ = shape
    R = len(rows)
    seqs, ns = [seq for seq, _ in rows], [n for _, n in rows]
    starts = [seq.pages.num_tokens for seq in seqs]
    if R == ns.count(1):  # every row decodes: its one token is the last known one
        ids = [seq.token_at(start) for seq, start in zip(seqs, starts)]
    else:
        ids = [t for seq, start, n in zip(seqs, starts, ns) for t in seq.tokens_between(start, start + n)]
    sample_rows = [start + n == seq.num_tokens for seq, start, n in zip(seqs, starts, ns)]
    n_rows, start_rows = np.asarray(ns, np.int32), np.asarray(starts, np.int32)  # [R]
    cu = np.zeros(B + 1, np.int32)  # [B+1]
    np.cumsum(n_rows, out=cu[1:R + 1])
    total = int(cu[R])
    cu[R + 1:] = total
    kv_lens, last_idx = np.zeros(B, np.int32), np.zeros(B, np.int32)  # [B]
    kv_lens[:R] = start_rows + n_rows
    last_idx[:R] = cu[1:R + 1] - 1
    tables = np.zeros((B, MP), np.int32)  # [B, MP] (padding: page 0; so are a row's pages past its KV)
    if R:
        held = np.stack([seq.page_array for seq in seqs])[:, :MP]  # [R, MP]
        used = -(-kv_lens[:R] // S)  # [R] pages holding each row's KV
        tables[:R] = np.where(np.arange(MP) < used[:, None], held, NULL_PAGE)
    row_of = np.repeat(np.arange(R), n_rows)  # [total] row of each packed token
    tokens, positions = np.zeros(T, np.int32), np.zeros(T, np.int32)  # [T]
    tokens[:total] = ids
    positions[:total] = np.arange(total) - cu[row_of] + start_rows[row_of]
    slot_pages, slot_offsets = np.full(T, NULL_PAGE, np.int32), np.zeros(T, np.int32)  # [T]
    slot_pages[:total] = tables[row_of, positions[:total] // S]
    slot_offsets[:total] = positions[:total] % S
    greedy = all(seq.params.temperature <= 0 for (seq, _), s in zip(rows, sample_rows) if s)
    batch = PackedBatch(tokens, positions, slot_pages, slot_offsets, cu, kv_lens, tables, last_idx)
    return batch, sample_rows, greedy


def sampling_arrays(rows, B: int, pen_rows: list[int] | None = None, mask: np.ndarray | None = None) -> tuple:
    """-> (seeds, steps, temperature, top_k, top_p, pen_row, presence, frequency, repetition,
    want_logprobs), each [B] numpy (padding rows: greedy, nothing else), then the token mask.
    `pen_rows`: each row's penalty table row (`PenaltyRows.prepare`; None: no row uses one);
    penalties are filled only for rows that have one, logprobs asked for every row that wants
    them. `mask`: int32 [B, ceil(V / 32)] (`token_masks`), or None when no row is constrained:
    then the step passes its shared all-ones mask (`step._arguments`)."""
    R = len(rows)
    seeds, steps, topk = np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
    temp, topp = np.zeros(B, np.float32), np.ones(B, np.float32)
    pen_row, presence, frequency = np.full(B, -1, np.int32), np.zeros(B, np.float32), np.zeros(B, np.float32)
    repetition, want = np.ones(B, np.float32), np.zeros(B, bool)
    if R:
        params = [seq.params for seq, _ in rows]
        seeds[:R] = [p.seed for p in params]
        steps[:R] = [len(seq.generated) for seq, _ in rows]
        topk[:R] = [p.top_k for p in params]
        temp[:R] = [p.temperature for p in params]
        topp[:R] = [p.top_p for p in params]
        want[:R] = [p.logprobs for p in params]
        if pen_rows is not None:
            pen_row[:R] = pen_rows
            on = [r for r in range(R) if pen_rows[r] >= 0]
            presence[on] = [params[r].presence_penalty for r in on]
            frequency[on] = [params[r].frequency_penalty for r in on]
            repetition[on] = [params[r].repetition_penalty for r in on]
    out = (seeds, steps, temp, topk, topp, pen_row, presence, frequency, repetition, want)
    return out if mask is None else (*out, mask)


def token_masks(rows, sample_rows: list[bool], B: int, words: int) -> np.ndarray | None:
    """The step's token mask: int32 [B, words], each constrained row that samples filled by its
    grammar's matcher (`seq.matcher`, pddjax/grammar/matcher.py), every other row all ones ->
    None when no row is constrained. Fresh every step (the step may read it asynchronously)."""
    pairs = [(seq.matcher, r) for r, (seq, _) in enumerate(rows) if sample_rows[r] and seq.matcher is not None]
    if not pairs:
        return None
    from pddjax.grammar.matcher import fill_masks  # llguidance is loaded only once a grammar is in use

    mask = np.full((B, words), -1, np.int32)  # [B, W]
    fill_masks(pairs, mask)
    return mask
