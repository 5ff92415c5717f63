"""Penalties and logit bias on a step's logits, and the device tables that hold their state.

The math (`apply`, on dense per-row arrays) is the one both engines run: the reference builds
the dense arrays on the host per token, the paged step gathers them from `Tables` by each
row's table row (`apply_rows`). Per row, in this order:
  repetition  (Hugging Face; tokens of the prompt or already generated) logit > 0 ? logit / r : logit * r
  frequency, presence  (OpenAI; generated tokens only) logit -= frequency * count + presence * (count > 0)
  logit_bias  logit += bias[token]
Temperature, top-k and top-p come after (sampling.py); logprobs read the raw logits.

`Tables` lives on the device, one row per penalised sequence (engines/penalty_state.py says
which): the step adds each sampled token to its row's counts (`record`), and `seed_row` (a
small program of its own) writes a row from token ids: at admission, and when a sequence
arrives with tokens generated elsewhere (the RLD -> MD handoff) or forgets some (a rollback).
Letters: C table rows, V vocabulary, B step rows, N bias entries, L token ids per seed call.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from pddjax.model.sampling_params import MAX_LOGIT_BIAS

NUM_BIAS = MAX_LOGIT_BIAS  # bias entries a table row holds (id -1: none)


@flax.struct.dataclass
class Tables:
    counts: jax.Array  # [C, V] int32 times each token was generated
    seen: jax.Array  # [C, V] bool token is in the prompt (repetition penalty only)
    bias_ids: jax.Array  # [C, N] int32 token ids of logit_bias (-1: none)
    bias_vals: jax.Array  # [C, N] float32 their biases

    @classmethod
    def zeros(cls, rows: int, vocab: int) -> Tables:
        return cls(jnp.zeros((rows, vocab), jnp.int32), jnp.zeros((rows, vocab), bool),
                   jnp.full((rows, NUM_BIAS), -1, jnp.int32), jnp.zeros((rows, NUM_BIAS), jnp.float32))

    @property
    def rows(self) -> int:
        return self.counts.shape[0]


def apply(logits, counts, seen, bias, presence, frequency, repetition):
    """logits, bias: [B, V] float32; counts: [B, V] int32 (generated); seen: [B, V] bool (prompt);
    presence, frequency, repetition: [B] float32 -> [B, V] float32 penalised and biased logits."""
    generated = counts > 0  # [B, V]
    r = repetition[:, None]
    out = jnp.where(seen | generated, jnp.where(logits > 0, logits / r, logits * r), logits)
    out = out - frequency[:, None] * counts.astype(jnp.float32) - presence[:, None] * generated.astype(jnp.float32)
    return out + bias


def dense_bias(ids, vals, vocab: int):
    """ids: [B, N] int32 (-1: none), vals: [B, N] float32 -> [B, V] float32 (0 where no bias)."""
    B = ids.shape[0]
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], ids.shape)
    return jnp.zeros((B, vocab), jnp.float32).at[rows, jnp.where(ids < 0, vocab, ids)].add(vals, mode="drop")


def apply_rows(logits, tables: Tables, pen_row, presence, frequency, repetition):
    """`apply` with each step row's state gathered from its table row; rows with pen_row -1
    come back unchanged. logits: [B, V] float32; pen_row: [B] int32; the rest [B] float32."""
    uses = pen_row >= 0  # [B]
    row = jnp.maximum(pen_row, 0)
    bias = dense_bias(tables.bias_ids[row], tables.bias_vals[row], logits.shape[-1])  # [B, V]
    out = apply(logits, tables.counts[row], tables.seen[row], bias, presence, frequency, repetition)
    return jnp.where(uses[:, None], out, logits)


def record(tables: Tables, pen_row, tokens) -> Tables:
    """Add each sampled token to its row's counts (rows with pen_row -1: nothing).
    pen_row, tokens: [B] int32."""
    row = jnp.where(pen_row >= 0, pen_row, tables.rows)  # out of range: dropped
    return tables.replace(counts=tables.counts.at[row, tokens].add(1, mode="drop"))


def seed_row(tables: Tables, row, prompt_ids, gen_ids, bias_ids, bias_vals, reset) -> Tables:
    """Write table row `row` ([] int32): cleared first when `reset` ([] bool), then prompt_ids
    marked seen and gen_ids counted (each [L] int32, -1: none), and its bias set ([N] each)."""
    V = tables.counts.shape[1]
    counts = jnp.where(reset, 0, tables.counts[row])  # [V]
    seen = jnp.where(reset, False, tables.seen[row])  # [V]
    counts = counts.at[jnp.where(gen_ids < 0, V, gen_ids)].add(1, mode="drop")
    seen = seen.at[jnp.where(prompt_ids < 0, V, prompt_ids)].set(True, mode="drop")
    return Tables(tables.counts.at[row].set(counts), tables.seen.at[row].set(seen),
                  tables.bias_ids.at[row].set(bias_ids), tables.bias_vals.at[row].set(bias_vals))


seed_row_jit = jax.jit(seed_row, donate_argnums=(0,))

