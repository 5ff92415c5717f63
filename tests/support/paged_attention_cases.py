"""Paged attention test cases shared by the XLA / Pallas tests and the native kernel's: ragged
batches of decode / extend / prefill / empty rows over scattered pages, and a float64 per-token
loop as the reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from pddjax.model.attention import Ragged

NUM_ROWS = 4  # B (padded batch)
NUM_TOKENS = 40  # T (packed query tokens, incl. padding)
MAX_Q_LEN = 16
MAX_KV = 64  # per-row KV capacity in tokens
KV_HEADS = 2
HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5

# (page size, GQA ratio, dtype, whose block sizes): every page size and ratio meets both dtypes.
CONFIGS = [
    (8, 1, "float32", "cpu"),
    (16, 3, "float32", "gpu"),
    (32, 4, "float32", "tpu"),
    (32, 4, "bfloat16", "gpu"),
    (16, 1, "bfloat16", "tpu"),
    (8, 3, "bfloat16", "split"),  # 8 one-page KV blocks over 3 kv splits (3 + 3 + 2)
]

# One row: (kind, q_len seed, cached-prefix seed). Lengths are derived so they always fit.
row_st = st.tuples(st.sampled_from(["empty", "decode", "extend", "prefill"]),
                   st.integers(1, MAX_Q_LEN), st.integers(0, MAX_KV))
batch_st = st.tuples(st.lists(row_st, min_size=NUM_ROWS, max_size=NUM_ROWS),
                     st.integers(0, 2**32 - 1))


def make_batch(rows, seed: int, page_size: int, group: int, dtype: str):
    """A ragged batch: decode / extend / prefill (+ cached prefix) / empty rows, scattered pages."""
    rng = np.random.default_rng(seed)
    max_pages = MAX_KV // page_size
    num_pages = 1 + NUM_ROWS * max_pages + 3  # page 0 is scratch
    q_lens, kv_lens, budget = [], [], NUM_TOKENS
    for kind, n, cached in rows:
        q_len = {"empty": 0, "decode": 1, "extend": 2 + n % 8, "prefill": n}[kind]
        q_len = min(q_len, budget)
        budget -= q_len
        q_lens.append(q_len)
        kv_lens.append(q_len + cached % (MAX_KV - q_len + 1) if q_len else 0)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    perm = rng.permutation(np.arange(1, num_pages))  # random, non-contiguous page tables
    page_tables = np.zeros((NUM_ROWS, max_pages), np.int32)
    for r in range(NUM_ROWS):
        n = -(-kv_lens[r] // page_size)
        page_tables[r, :n] = perm[r * max_pages: r * max_pages + n]
    q = rng.standard_normal((NUM_TOKENS, KV_HEADS * group, HEAD_DIM), np.float32)
    k = rng.standard_normal((KV_HEADS, num_pages, page_size, HEAD_DIM), np.float32)
    v = rng.standard_normal((KV_HEADS, num_pages, page_size, HEAD_DIM), np.float32)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    return q, k, v, jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32), jnp.asarray(page_tables)


def numpy_reference(q, k, v, cu, kv_lens, page_tables, sm_scale):
    """One query token and one head at a time, float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    cu, kv_lens, page_tables = (np.asarray(x) for x in (cu, kv_lens, page_tables))
    out = np.zeros(q.shape, np.float64)
    heads, kv_heads, page_size = q.shape[1], k.shape[0], k.shape[2]
    for r in range(len(kv_lens)):
        q_len = cu[r + 1] - cu[r]
        for i in range(q_len):
            pos = kv_lens[r] - q_len + i
            pages = [page_tables[r, p // page_size] for p in range(pos + 1)]
            offs = [p % page_size for p in range(pos + 1)]
            for h in range(heads):
                kh = h // (heads // kv_heads)
                keys, vals = k[kh, pages, offs], v[kh, pages, offs]  # [pos+1, D]
                s = keys @ q[cu[r] + i, h] * sm_scale
                w = np.exp(s - s.max())
                out[cu[r] + i, h] = (w / w.sum()) @ vals
    return out


def flat(fn, max_q_len=MAX_Q_LEN, sm_scale=SCALE):
    """fn(q, k, v, rows, **kw) called as fn(q, k, v, cu_q_lens, kv_lens, page_tables, **kw)."""
    return lambda q, k, v, cu, kv, pt, **kw: fn(q, k, v, Ragged(cu, kv, pt, max_q_len, sm_scale), **kw)



def as_np(x):
    return np.asarray(x.astype(jnp.float32))
