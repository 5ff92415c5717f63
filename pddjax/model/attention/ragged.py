"""What every paged attention reads besides q and the pool: a packed step's rows.

Rows are packed along tokens: row r owns query tokens cu_q_lens[r]:cu_q_lens[r+1] of q [T, H, D]
and attends causally over its first kv_lens[r] KV positions (its new tokens included, already
written), found through page_tables[r]. Query i of row r sits at kv_lens[r] - q_len[r] + i.
`max_q_len` (a bound on every row's query tokens) and `sm_scale` are static: they shape the
compiled program.
"""

from __future__ import annotations

import flax.struct
import jax


@flax.struct.dataclass
class Ragged:
    cu_q_lens: jax.Array  # [B+1] int32: row r owns packed query tokens cu_q_lens[r]:cu_q_lens[r+1]
    kv_lens: jax.Array  # [B] int32: row r's KV length, its new tokens included
    page_tables: jax.Array  # [B, MP] int32: row r's pages in order (padding: page 0, the scratch page)
    max_q_len: int = flax.struct.field(pytree_node=False)  # static: >= every row's query tokens
    sm_scale: float = flax.struct.field(pytree_node=False)  # static: the logits' scale (head_dim ** -0.5)
