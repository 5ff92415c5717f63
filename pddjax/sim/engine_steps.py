"""Time of one packed step of pddjax's paged engine, from a measured profile (one host).

The engine runs every sequence with pending tokens in one step: rows sorted by pending
tokens (fewest first), at most `max_step_tokens` tokens and `max_rows` rows. Shapes are
bucketed (`pddjax/engines/buckets.py`): T tokens and B rows to powers of two, the longest
row's query length Q to a power of two, the page-table width to multiples of 8 pages (then
powers of two), so the KV run each row attends over has C = width * page_size slots.

On CPU the XLA attention gathers each row's KV run and does dense masked attention over
the padded [B, Q] x [B, C] block, so a step costs

    step = lin(T) + rows(B_dec) + a * B * Q * C + G(B * C)

- lin(T): the token-proportional part (weights, matmuls) at T = bucketed tokens, from the
  profile's extend_ms (one row of k tokens) and its 512-token prefill, minus their own
  attention terms;
- rows(B_dec): what B_dec sampled decode rows cost beyond lin(B_dec) (LM head, sampling;
  may be negative), from decode_ms[B] - lin(B) minus its attention;
- a (`attention_ns_per_pair`) and the gather G: the KV copied per step is B * C slots of
  kv_bytes_per_token each; G costs `gather_ns_per_slot` per slot up to
  `gather_knee_slots` (the copy stays in the CPU's caches) and `gather_far_ns_per_slot`
  beyond (memory-bound: measured 2.7x dearer here). Measured separately (`python -m
  tools.hostlab.calibrate`): `bench engine` times at one context (256) only.
With a = G = 0 this is the profile's interpolation without context.

A measured `step_table` (`python -m tools.hostlab.step_table`: each shape the trace uses, timed
on the engine) replaces the formula where it has the shape: XLA computes the whole padded
block, so a step's time depends on its bucketed shape only. Shapes it lacks get the formula
scaled by the table's median measured / formula ratio (one correction for how this host
runs now, e.g. a profile taken under other load).

`shapes` counts the step shapes (T, B, page-table width, Q) used: a shape the engine has
not run before costs `first_use_ms` more on first use (pddjax lowers it and loads its
executable from the persistent compilation cache; `step_table --first-use` measures it).
A shape never compiled on the host at all would cost seconds more; the benchmark's earlier
modes and warm-up fill the persistent cache, so the model does not time that.
"""

from __future__ import annotations

from pddjax.sim.measured import MeasuredInstance, interp
from pddjax.sizes import pow2_at_least


def table_width(kv_tokens: int, page_size: int) -> int:
    """The page-table bucket of a row holding kv_tokens (pddjax.engines.buckets.pages_bucket)."""
    pages = max(1, -(-kv_tokens // page_size))
    return max(8, -(-pages // 8) * 8) if pages <= 64 else pow2_at_least(pages)


def kv_slots(kv_tokens: int, page_size: int) -> int:
    """C: KV slots a row attends over for a context of kv_tokens (page-table bucket)."""
    return table_width(kv_tokens, page_size) * page_size


class StepModel:
    """`step_s(decode_rows, decode_kv, chunks)`: solo seconds of one engine step."""

    def __init__(self, perf: MeasuredInstance):
        self.perf = perf
        self.a = perf.attention_ns_per_pair * 1e-9
        self.g = perf.gather_ns_per_slot * 1e-9
        self.g_far = (perf.gather_far_ns_per_slot or perf.gather_ns_per_slot) * 1e-9
        self.knee = perf.gather_knee_slots
        S, ctx = perf.page_size, perf.context
        lin = [(k, t - self._attn(1, pow2_at_least(k), kv_slots(ctx + k, S))) for k, t in perf.extend]
        n = 512  # `bench engine`'s prefill: one 512-token prompt in one step
        if all(k < n for k, _ in lin):
            lin.append((n, n / perf.prefill_tokens_per_s - self._attn(1, n, kv_slots(n, S))))
        self._lin = [(k, max(t, 1e-6)) for k, t in lin]
        # may be negative: `bench engine` times a 1-token decode step below a 1-token extend step
        self._rows = [(b, t - self._attn(pow2_at_least(int(b)), 1, kv_slots(ctx + 16, S)) - self.lin(int(b)))
                      for b, t in perf.decode]
        self.shapes: dict[tuple[int, int, int, int], int] = {}  # (T, B, width, Q) -> steps run
        self.seconds = 0.0  # solo seconds of every step timed so far
        self.table = dict(perf.step_table)  # (T, B, width, Q) -> seconds, measured
        ratios = sorted(t / self._formula(*k) for k, t in self.table.items())
        self.scale = ratios[len(ratios) // 2] if ratios else 1.0

    def _formula(self, T: int, B: int, width: int, Q: int, decode_rows: int = 0) -> float:
        t = self.lin(T) + self._attn(B, Q, width * self.perf.page_size)
        if decode_rows:
            t += interp(self._rows, decode_rows)
        return max(t, 1e-6)

    def _attn(self, rows: int, q: int, slots: int) -> float:
        x = rows * slots  # KV slots gathered
        near = min(x, self.knee)
        return self.a * rows * q * slots + self.g * near + self.g_far * (x - near)

    def lin(self, tokens: int) -> float:
        """Token-proportional seconds of a step of `tokens` (bucketed) tokens."""
        return interp(self._lin, pow2_at_least(max(1, tokens)))

    def step_s(self, decode_rows: int = 0, decode_kv: int = 0, chunks: list[tuple[int, int]] = ()) -> float:
        """A step with `decode_rows` one-token rows (longest context `decode_kv` after the
        step) and multi-token rows `chunks` = [(tokens, context after the step)]."""
        tokens = decode_rows + sum(q for q, _ in chunks)
        if tokens <= 0:
            return 0.0
        rows = decode_rows + len(chunks)
        q = max([1] * (decode_rows > 0) + [k for k, _ in chunks])
        kv = max([decode_kv] * (decode_rows > 0) + [c for _, c in chunks])
        key = (pow2_at_least(tokens), pow2_at_least(rows), table_width(kv, self.perf.page_size), pow2_at_least(q))
        t = self.table[key] if key in self.table else self.scale * self._formula(*key, decode_rows=decode_rows)
        if key not in self.shapes:
            t += self.perf.first_use_s  # this engine lowers the shape and loads its executable
        self.shapes[key] = self.shapes.get(key, 0) + 1
        self.seconds += t
        return t
