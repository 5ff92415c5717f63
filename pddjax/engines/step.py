"""The jitted compute entry point of the paged engines: a packed ragged batch in, one sampled
token per row out, the KV pool donated and updated in place.

A step is two programs, run back to back (`run`): the forward (`_forward`: the model over the
packed batch, the pool updated, logits [B, V] of each row's last token) and the sampler
(`_sample`). The forward's program depends on the step's shape (T, B, MP, Q); the sampler's on
the row count B alone, so an engine compiles one sampler per B of its stated set, not one per
member (a fused step spent ~55% of its compile in the sampler: tiny model and real model alike).

Static: model config, attention implementation, max row length Q. Greedy is an argument, not a
static: `lax.cond` runs argmax or the draw, so greedy and sampled steps share one executable per
shape. So are penalties, logit bias and logprobs (`sampling.sample_step`): per-row arrays of
shape [B] and the engine's penalty tables (`penalties.Tables`, [ROWS, V], donated like the pool:
the sampler counts each sampled token in its row), each part skipped by `lax.cond` when no row of
the step uses it. So is the token mask of constrained decoding (int32 [B, ceil(V / 32)],
`model/token_mask.py`; all ones for an unconstrained row, and the whole masking skipped when every
row is all ones). They add no member to the shape set and no key: every step of an engine passes
them, of the same shapes (a caller that leaves the mask out gets a shared all-ones one of the
same shape and dtype).

An engine runs only the shapes of its stated set (`buckets.bucket_set`) and builds them all, and
a sampler per B, before it serves (`PagedEngine.precompile` -> `build_step`). The programs are
held in one LRU (engines/executables.py) of at most `PDDJAX_STEP_EXECUTABLES` (default 128,
raised by `precompile` to hold its set). `compile_count()` counts programs built in this process
(tests assert a steady workload adds none), `resident_count()` those held now.

Tensor parallel (`layout`, an `engines.mesh.EngineMesh` of degree > 1): the same two programs,
jitted with explicit in / out shardings (weights by their logical axes, the pool by KV heads or
replicated, batch and sampling arrays replicated; the pool out as it came in, donated; the
logits out replicated, gathered at the forward's end) and the mesh as a static of the forward,
so every device samples the same token. At degree 1 nothing changes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pddjax import env
from pddjax.engines import penalty_state
from pddjax.engines.executables import Executables, compiler_options, release_jax_caches
from pddjax.kv.pool import KVPool
from pddjax.model import token_mask
from pddjax.model.paged import PackedBatch, forward_paged
from pddjax.model.penalties import Tables
from pddjax.model.sampling import sample_step

STATICS = ("cfg", "max_q_len", "impl")  # the forward's
NUM_SAMPLING = 11  # per-step sampling arrays (`sampling.sample_step`): ten [B], the token mask [B, W]


class StepOut(NamedTuple):
    tokens: jax.Array  # [B] int32
    logprobs: tuple  # (chosen [B] f32, top ids [B, 20] i32, top logprobs [B, 20] f32); zeros unless a row asked
    logits: jax.Array | None  # [B, V] float32 (return_logits only)
    pool: KVPool
    tables: Tables | None  # the penalty tables, sampled tokens counted (None: none passed)


def _forward(w, batch: PackedBatch, pool, *, cfg, max_q_len: int, impl: str, mesh=None, kv_sharded: bool = True):
    logits, pool = forward_paged(w, cfg, batch, pool, max_q_len=max_q_len, impl=impl, mesh=mesh,
                                 kv_sharded=kv_sharded)  # [B, V] float32
    if mesh is not None:  # sampling on replicated logits: every device draws the same token
        from jax.sharding import NamedSharding, PartitionSpec

        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, PartitionSpec()))
    return logits, pool


def _sample(logits, tables, ints, floats, mask, greedy):
    # logits: [B, V] float32; ints: [5, B] int32 (seeds, steps, top_k, pen_row, want_logprobs);
    # floats: [5, B] float32 (temperature, top_p, presence, frequency, repetition);
    # mask: [B, ceil(V / 32)] int32; greedy: [] bool; tables: Tables or None
    seeds, steps, top_k, pen_row, want = ints
    temperature, top_p, presence, frequency, repetition = floats
    sp = (seeds, steps, temperature, top_k, top_p, pen_row, presence, frequency, repetition, want != 0, mask)
    return sample_step(logits, tables, sp, greedy)  # tokens [B], logprobs, tables


_single = {"forward": jax.jit(_forward, static_argnames=STATICS, donate_argnames=("pool",)),
           "sample": jax.jit(_sample, donate_argnames=("tables",))}


@functools.lru_cache(maxsize=64)
def _sharded_forward(layout, w_tree, statics: tuple):
    """`_forward` jitted for one mesh layout, weights tree and statics, shardings stated in and
    out (jit takes no keyword arguments with in_shardings: the statics are bound first)."""
    rep, pool = layout.replicated, layout.pool_sharding
    w_shardings = layout.weight_shardings(jax.tree_util.tree_unflatten(w_tree, [0] * w_tree.num_leaves))
    return jax.jit(functools.partial(_forward, **dict(statics)), donate_argnums=(2,),
                   in_shardings=(w_shardings, rep, pool), out_shardings=(rep, pool))


@functools.lru_cache(maxsize=8)
def _sharded_sample(layout):
    rep = layout.replicated
    return jax.jit(_sample, donate_argnums=(1,), in_shardings=(rep,) * 6, out_shardings=rep)


class _Bound:
    """A sharded program for `Executables.build`: `.lower(*args, **statics)` like a jit's."""

    def __init__(self, program: str, layout, args):
        self.program, self.layout = program, layout
        self.w_tree = jax.tree_util.tree_structure(args[0]) if program == "forward" else None

    def lower(self, *args, **statics):
        if self.program == "forward":
            return _sharded_forward(self.layout, self.w_tree, tuple(sorted(statics.items()))).lower(*args)
        return _sharded_sample(self.layout).lower(*args)


def _jitted(program: str, args: tuple, layout):
    if not _sharded(layout):
        return _single[program]
    return _Bound(program, layout, args)


def _sharded(layout) -> bool:
    return layout is not None and layout.mesh is not None


@functools.lru_cache(maxsize=64)
def _logits_key(B: int, V: int):
    """What stands for the logits in the sampler's key: their shape and dtype, nothing else."""
    return jax.ShapeDtypeStruct((B, V), jnp.float32)


_executables = Executables(env.STEP_EXECUTABLES.get())  # read once: the cache is process-wide


def neutral_sampling(B: int, vocab_size: int | None = None) -> tuple:
    """The per-step sampling arrays of B greedy rows that use nothing else, numpy, in the dtypes
    the serving loop passes (`step_batch.sampling_arrays`, `precompile.dummy_batch`): the ten [B]
    arrays, then the all-ones token mask [B, ceil(vocab_size / 32)] when `vocab_size` is given
    (else the step adds it: `_arguments`)."""
    z = np.zeros
    out = (z(B, np.int32), z(B, np.int32), z(B, np.float32), z(B, np.int32), np.ones(B, np.float32),
           np.full(B, -1, np.int32), z(B, np.float32), z(B, np.float32), np.ones(B, np.float32), z(B, bool))
    return out if vocab_size is None else (*out, token_mask.all_allowed(B, vocab_size))


@functools.lru_cache(maxsize=32)
def _no_mask(B: int, vocab_size: int) -> np.ndarray:
    """The all-ones mask a step without constrained rows passes, one read-only array per shape
    (never written, so a step may read it while the next is built)."""
    mask = token_mask.all_allowed(B, vocab_size)
    mask.flags.writeable = False
    return mask


def _arguments(w, cfg, batch, pool, tables, sampling, greedy, max_q_len, impl, layout):
    """-> (the forward's arguments, its statics, the sampler's arguments after the logits)."""
    # batch and sampling arrays are numpy (host): the compiled programs' C++ dispatch transfers
    # them; `precompile` builds with numpy too, so the executable keys below match. A caller
    # of the first five arrays only (seeds .. top_p) gets the rest neutral; one of the ten [B]
    # arrays, the shared all-ones mask.
    sampling = tuple(sampling)
    if len(sampling) < NUM_SAMPLING - 1:
        sampling += neutral_sampling(len(sampling[0]))[len(sampling):]
    if len(sampling) < NUM_SAMPLING:
        sampling += (_no_mask(len(sampling[0]), cfg.vocab_size),)
    host = _packed(sampling, greedy)
    statics = {"cfg": cfg, "max_q_len": max_q_len, "impl": impl}
    if _sharded(layout):
        statics.update(mesh=layout.mesh, kv_sharded=layout.kv_sharded)
        batch, host = layout.put_replicated(batch), layout.put_replicated(host)
    return (w, batch, pool), statics, (tables, *host)


def _packed(sampling: tuple, greedy) -> tuple:
    """The NUM_SAMPLING arrays as the sampler takes them (fewer arrays, fewer transfers per step):
    (ints [5, B] int32, floats [5, B] float32, mask [B, W] int32, greedy [] bool)."""
    seeds, steps, temperature, top_k, top_p, pen_row, presence, frequency, repetition, want, mask = sampling
    ints = np.stack([seeds, steps, top_k, pen_row, want], dtype=np.int32)
    floats = np.stack([temperature, top_p, presence, frequency, repetition], dtype=np.float32)
    return ints, floats, mask, np.asarray(bool(greedy))


def run(w, cfg, batch: PackedBatch, pool, sampling: tuple, tables: Tables | None, *, max_q_len: int, impl: str,
        greedy: bool, return_logits: bool = False, layout=None) -> StepOut:
    """One step: forward, then sample. `pool` and `tables` are donated: use the ones returned.
    `sampling`: the NUM_SAMPLING arrays of `sampling.sample_step`; `tables`: the engine's
    penalty tables (None: no penalties, what a multi-host instance runs). `layout`: the engine's
    `EngineMesh` (None or degree 1: one device). `return_logits`: the logits in the result too."""
    fargs, statics, sargs = _arguments(w, cfg, batch, pool, tables, sampling, greedy, max_q_len, impl, layout)
    forward, _ = _build_forward(fargs, statics, layout, False)
    logits, pool = forward(*fargs)  # [B, V] float32
    sample, _ = _build_sample(cfg, sargs, layout, False)
    tokens, lp, tables = sample(logits, *sargs)
    return StepOut(tokens, lp, logits if return_logits else None, pool, tables)


def run_step(w, cfg, batch: PackedBatch, pool, *sampling, max_q_len: int, impl: str, greedy: bool,
             return_logits: bool = False, layout=None):
    """`run` without penalty tables -> (tokens [B] int32, logits [B, V] or None, pool): the step a
    multi-host instance's processes run (engines/multihost.py replays it)."""
    out = run(w, cfg, batch, pool, sampling, None, max_q_len=max_q_len, impl=impl, greedy=greedy,
              return_logits=return_logits, layout=layout)
    return out.tokens, out.logits, out.pool


def serving_tables(cfg, layout=None) -> Tables | None:
    """Penalty tables as a PagedEngine of this model and layout holds them (zeros), or None on a
    multi-host instance (penalties off there: engines/penalty_state.py)."""
    if jax.process_count() > 1:
        return None
    tables = Tables.zeros(penalty_state.ROWS, cfg.vocab_size)
    return layout.put_replicated(tables) if _sharded(layout) else tables


@functools.lru_cache(maxsize=4)
def _built_tables(cfg, layout) -> Tables | None:
    """Zero tables to build steps with (never donated: nothing runs), one per model and layout."""
    return serving_tables(cfg, layout)


class StepPrograms(NamedTuple):
    """A step's two compiled programs (`jax.stages.Compiled` or their loaded equivalents), and
    how many of them `build_step` built (0, 1 or 2; a held one counts 0)."""

    forward: object
    sample: object
    built: int

    def as_text(self) -> str:
        """Both programs' HLO, the forward's first."""
        return self.forward.as_text() + "\n" + self.sample.as_text()


def build_step(w, cfg, batch: PackedBatch, pool, sampling: tuple, *, max_q_len: int, impl: str, layout=None,
               behind: bool = False) -> StepPrograms:
    """Compile (or load) the serving programs of these shapes without running them. The penalty
    tables are the engine's shape and placement (`serving_tables`). `behind`: counted as a
    background build's."""
    tables = _built_tables(cfg, layout)
    fargs, statics, sargs = _arguments(w, cfg, batch, pool, tables, sampling, False, max_q_len, impl, layout)
    forward, built = _build_forward(fargs, statics, layout, behind)
    sample, more = _build_sample(cfg, sargs, layout, behind)
    return StepPrograms(forward, sample, built + more)


def build_sampler(cfg, B: int, layout=None, behind: bool = False) -> int:
    """Compile (or load) the sampler of B rows alone -> programs built now (0 or 1)."""
    host = _packed(neutral_sampling(B, cfg.vocab_size), False)
    if _sharded(layout):
        host = layout.put_replicated(host)
    return _build_sample(cfg, (_built_tables(cfg, layout), *host), layout, behind)[1]


def _build_forward(fargs: tuple, statics: dict, layout, behind: bool):
    """-> (the forward's executable for these arguments, whether it was built now)."""
    return _executables.build("forward", lambda: _jitted("forward", fargs, layout), fargs, statics,
                              sharded=_sharded(layout), behind=behind, options=lambda: compiler_options(statics["cfg"]))


def _build_sample(cfg, sargs: tuple, layout, behind: bool):
    """-> (the sampler's executable for these arguments after the logits, whether it was built
    now). The logits stand in the key (and in a build's lowering) by shape and dtype alone."""
    logits = _logits_key(sargs[1].shape[1], cfg.vocab_size)  # ints: [5, B]
    return _executables.build("sample", lambda: _jitted("sample", sargs, layout), (logits, *sargs), {},
                              key_args=(logits, *sargs), sharded=_sharded(layout), behind=behind,
                              options=lambda: compiler_options(cfg))


def release_tracing_caches() -> None:
    """After building many variants: drop JAX's per-shape lowering caches (held executables stay)."""
    release_jax_caches()


def compile_count() -> int:
    """Variants of the step built in this process (evicted ones that came back count again),
    and of the penalty tables' seed program."""
    return _executables.built + penalty_state.seed_builds()


def compile_count_foreground() -> int:
    """Of `compile_count()`, the variants compiled on any thread but a background build's."""
    built, behind = _executables.counts()
    return built - behind + penalty_state.seed_builds()


def resident_count() -> int:
    """Variants held in memory now (<= PDDJAX_STEP_EXECUTABLES)."""
    return len(_executables)


def executables() -> Executables:
    return _executables
