"""Which sequence owns which row of an engine's penalty tables, and keeping each row equal to
its sequence's tokens (host bookkeeping; the device math is pddjax/model/penalties.py).

A sequence that uses a penalty or logit_bias (`SamplingParams.penalised`) gets a table row the
first time it samples (`prepare`), seeded from its token ids: prompt presence (repetition
penalty only), generated counts, its bias. From then on the step counts each token it samples
there, and `seq.pen_counted` says how many of `seq.generated` the row holds. Tokens appended
from elsewhere (the RLD -> MD handoff: a fresh engine admits the prompt and the tokens
generated so far) are added before the next sample; a rollback below the count, or an evicted
row, reseeds in full. So the state depends only on the token ids, never on which engine
sampled them. A row is freed when its sequence finishes or is released; with every row taken,
the least recently used sequence outside the step loses its row (it is reseeded when it
samples again). A step holds at most ROWS penalised rows (`PagedEngine` keeps the others
waiting).

Seeding runs `penalties.seed_row` over SEED_CHUNK ids at a time: one compiled program per
table layout, built by `PagedEngine.precompile`, counted in `step.compile_count()`.
"""

from __future__ import annotations

import jax
import numpy as np

from pddjax.model.penalties import NUM_BIAS, Tables, seed_row_jit

ROWS = 64  # penalised sequences an engine's tables hold at once ([ROWS, V] int32 + bool: 15.7 MB at V = 49152)
SEED_CHUNK = 256  # token ids per seed call

_seeds: dict = {}  # table signature -> compiled seed program


def _signature(tables: Tables) -> tuple:
    return tuple((x.shape, x.dtype, x.sharding) for x in jax.tree_util.tree_leaves(tables))


def _seed_args(row: int, prompt_ids, gen_ids, bias: tuple, reset: bool) -> tuple:
    """Host arrays of one seed call: ids padded with -1 to SEED_CHUNK, bias to NUM_BIAS."""
    p, g = np.full(SEED_CHUNK, -1, np.int32), np.full(SEED_CHUNK, -1, np.int32)  # [L]
    p[:len(prompt_ids)], g[:len(gen_ids)] = prompt_ids, gen_ids
    ids, vals = np.full(NUM_BIAS, -1, np.int32), np.zeros(NUM_BIAS, np.float32)  # [N]
    if bias:
        ids[:len(bias)] = [t for t, _ in bias]
        vals[:len(bias)] = [b for _, b in bias]
    return np.int32(row), p, g, ids, vals, np.asarray(reset)


def seed_program(tables: Tables):
    """The compiled seed program for tables laid out as these (compiled now if new)."""
    key = _signature(tables)
    fn = _seeds.get(key)
    if fn is None:
        fn = _seeds[key] = seed_row_jit.lower(tables, *_seed_args(0, [], [], (), True)).compile()
    return fn


def seed_builds() -> int:
    """Seed programs compiled in this process."""
    return len(_seeds)


class PenaltyRows:
    def __init__(self, tables: Tables):
        self.tables = tables  # on the device; the step donates and returns it
        self.owner: list = [None] * tables.rows  # row -> Sequence
        self.used = [0] * tables.rows  # row -> the last `prepare` that used it
        self._clock = 0
        self.seed_calls = 0

    def build(self) -> None:
        """Compile (or load) the seed program before serving."""
        seed_program(self.tables)

    def prepare(self, rows, sample_rows: list[bool]) -> list[int] | None:
        """Each step row's table row (-1: none; only penalised rows that sample get one), every
        such row brought up to its sequence's tokens first -> None when no row needs one."""
        want = [r for r, (seq, _) in enumerate(rows) if sample_rows[r] and seq.params.penalised]
        if not want:
            return None
        self._clock += 1
        stepping = {id(seq) for seq, _ in rows}
        out = [-1] * len(rows)
        for r in want:
            seq = rows[r][0]
            if seq.pen_row < 0:
                self._assign(seq, stepping)
            self._sync(seq)
            self.used[seq.pen_row] = self._clock
            out[r] = seq.pen_row
        return out

    def counted(self, seq) -> None:
        """The step counted the token `seq` just recorded (its row now holds all of generated)."""
        seq.pen_counted = len(seq.generated)

    def free(self, seq) -> None:
        """Give back `seq`'s row (finished or released); reseeded in full if it samples again."""
        if seq.pen_row >= 0 and self.owner[seq.pen_row] is seq:
            self.owner[seq.pen_row] = None
        seq.pen_row, seq.pen_counted = -1, -1

    def used_by(self, seq) -> int:
        """When `seq`'s row last served a step (0: it holds none)."""
        return self.used[seq.pen_row] if seq.pen_row >= 0 else 0

    def check_integrity(self, seqs: dict) -> None:
        """Every row held by a live sequence that names it, and no sequence naming another's row."""
        for c, s in enumerate(self.owner):
            if s is not None:
                assert seqs.get(s.seq_id) is s and s.pen_row == c, f"penalty row {c} is held by a stale sequence"
        for s in seqs.values():
            assert s.pen_row < 0 or self.owner[s.pen_row] is s, \
                f"{s.seq_id} names penalty row {s.pen_row}, which it does not own"

    def _assign(self, seq, stepping: set) -> None:
        free = [c for c, s in enumerate(self.owner) if s is None]
        if not free:
            held = [c for c, s in enumerate(self.owner) if id(s) not in stepping]
            if not held:
                raise RuntimeError(f"all {len(self.owner)} penalty table rows are taken by this step's rows")
            c = min(held, key=lambda c: self.used[c])
            self.free(self.owner[c])
            free = [c]
        seq.pen_row, seq.pen_counted = free[0], -1
        self.owner[free[0]] = seq

    def _sync(self, seq) -> None:
        """Seed `seq`'s row from its tokens: in full when pen_counted is -1, else the generated
        tokens past it."""
        p = seq.params
        n = len(seq.generated)
        if 0 <= seq.pen_counted == n:
            return
        full = seq.pen_counted < 0
        prompt = seq.prompt if full and p.repetition_penalty != 1.0 else []
        gen = seq.generated if full else seq.generated[seq.pen_counted:]
        fn, first = seed_program(self.tables), True
        for i in range(0, max(len(prompt), len(gen), 1), SEED_CHUNK):
            args = _seed_args(seq.pen_row, prompt[i:i + SEED_CHUNK], gen[i:i + SEED_CHUNK], p.logit_bias,
                              full and first)
            self.tables = fn(self.tables, *args)
            self.seed_calls += 1
            first = False
        seq.pen_counted = n
