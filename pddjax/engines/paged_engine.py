"""The paged engine behind every role: a KV pool, its allocator and radix prefix cache, and
continuous batching of sequences through one jitted step.

A request's life on an engine:
  add()            match the prefix cache (lock + ref the shared pages), reserve pages for
                   prompt + max_tokens (evicting unlocked cache pages if needed);
  import_kv()      optional: KV computed elsewhere (P -> RLD/MD) lands in its pages;
  append_tokens()  optional: token IDs produced elsewhere (the RLD -> MD handoff);
  step()           every sequence with pending tokens becomes one row of a packed batch:
                   prefill chunk, multi-token extend or one-token decode, all in one forward;
                   a row that catches up samples the next token; the batch is padded to a
                   member of the engine's stated shape set (`buckets.bucket_set`), never
                   to a shape outside it (`precompile()` builds them all up front);
  export_kv()      read tokens' KV out in the canonical form (P -> RLD/MD);
  release()        insert the computed context into the prefix cache, drop the page refs.

Tensor parallel (`EngineConfig.tensor_parallel` = N > 1): `self.layout` (engines/mesh.py) is a
mesh over N local devices; the weights and the pool live sharded on it (the pool over KV
heads, or replicated when the model has fewer KV heads than N) and every step runs the one
sharded executable of its shape. Callers see the same API; KV export gathers the shards.

Sampling state: penalties and logit_bias read the engine's penalty tables (`self.penalties`,
engines/penalty_state.py: a row per penalised sequence, rebuilt from token ids whenever the
tokens come from elsewhere); a request with `logprobs` gets them on each TokenEvent. Neither
changes a step's shape. A multi-host instance holds no tables and refuses penalised requests.
Constrained decoding (`SamplingParams.grammar`): the engine's `grammar` compiler (built from the
model's tokenizer, pddjax/grammar/; None: constrained requests refused) gives each such sequence
a matcher at `add`; before a step, each constrained row that samples fills its row of the
step's token mask (int32 [B, ceil(V / 32)], all ones elsewhere; no mask array at all when no
row is constrained); each token recorded or appended advances its matcher (Sequence), and a
complete grammar finishes the row with "stop". The next mask depends on the token the step
being run samples, so it is filled after the step returns, on the host, before the next one.

Device calls: a step's forward (`_device_step`), a KV import's write (`_write_kv`), a KV
export's read (`_read_kv`) and a penalty row's seeding (`PenaltyRows`) are the engine's only
calls that touch devices; a multi-host leader (engines/multihost.LeaderEngine) overrides the
first three to tell its followers first.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from pddjax.engines import buckets, speculate, step_batch
from pddjax.engines.engine_api import Engine, TokenEvent, TokenLogprobs
from pddjax.engines.engine_config import EngineConfig
from pddjax.engines.mesh import EngineMesh
from pddjax.engines.penalty_state import PenaltyRows
from pddjax.engines.sequence import Sequence
from pddjax.engines.step import run, serving_tables
from pddjax.kv.allocator import OutOfPages, PageAllocator
from pddjax.kv.canonical import KVImportError, KVRun, export_shards, from_token, import_run, join_heads, span
from pddjax.kv.page_hash import chain_hashes
from pddjax.kv.page_table import SequencePages, pages_needed
from pddjax.kv.pool import KVPool
from pddjax.kv.radix_cache import RadixCache
from pddjax.model import weights as wmod
from pddjax.model.attention import IMPLS, default_impl, native_paged
from pddjax.model.config import ModelConfig
from pddjax.model.sampling_params import GREEDY, SamplingParams

IDLE_GAP = 0.25  # seconds after a step's end that the engine still counts as busy (`busy`)


class PagedEngine(Engine):
    def __init__(self, cfg: ModelConfig, weights: wmod.Weights, fingerprint: str,
                 config: EngineConfig | None = None, grammar=None):
        config = config or EngineConfig()
        if config.attention == "auto":
            config = dataclasses.replace(config, attention=default_impl())
        if config.attention not in IMPLS:
            raise ValueError(f"unknown attention {config.attention!r}; expected one of {IMPLS} or 'auto'")
        if config.attention == "native" and not native_paged.available():  # registers the kernel with XLA
            raise ValueError("attention 'native' is unavailable on this machine (the log says why); "
                             "use 'auto' or 'xla'")
        tp = config.tensor_parallel
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel must be a positive integer, got {tp!r}")
        self.cfg, self.config, self.fingerprint = cfg, config, fingerprint
        self.layout = EngineMesh.build(cfg, config.tensor_parallel)  # ValueError: degree not admitted / no devices
        weights = wmod.for_engine(weights, self.layout.mesh is None)
        if wmod.wants_panels(weights, config.attention, self.layout.mesh is None, config.dtype):
            weights = wmod.in_panels(weights)  # steps of few tokens read them in place
        weights = wmod.cast(weights, jnp.dtype(config.dtype))
        self.weights = self.layout.put_weights(weights)
        self.pool = self.layout.put_pool(KVPool.zeros(cfg.num_layers, cfg.num_kv_heads, config.num_pages,
                                                      config.page_size, cfg.head_dim, jnp.dtype(config.dtype)))
        self.allocator = PageAllocator(config.num_pages)
        self.radix = RadixCache(config.page_size, self.allocator)
        tables = serving_tables(cfg, self.layout)  # None on a multi-host instance
        self.penalties = PenaltyRows(tables) if tables is not None else None
        self.grammar = grammar  # a pddjax.grammar.compiler.GrammarCompiler for this model's tokenizer, or None
        self._mask_words = (cfg.vocab_size + 31) // 32  # int32 words of a token mask row
        self.seqs: dict[str, Sequence] = {}
        self.stated = buckets.bucket_set(config, cfg)  # every (T, B, MP, Q) a step may have
        self.shapes = list(self.stated)  # the members a step may take now (those built: `precompile`)
        self.background = None  # precompile's BackgroundBuild of the rest (ready "cover")
        self._step_started = self._step_ended = 0.0  # perf_counter at the last step's start and end (`busy`)
        self._table_width = max(mp for _, _, mp, _ in self.stated)  # a Sequence's page_array length
        self.num_steps = 0
        self.spec_drafted = self.spec_accepted = 0  # draft tokens verified / accepted (speculate.py)
        self.step_costs = speculate.StepCosts()  # decode-only step seconds by rows: what a draft costs
        self._multi_first = False  # the last step left a multi-token row out: those go first (buckets.step_order)
        self.last_shape: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)  # (T, B, MP, Q, rows) of the last step

    # ---- queries (no mutation) -------------------------------------------------------
    def prefix_hit(self, prompt: list[int]) -> int:
        """Tokens of `prompt` this engine's prefix cache holds. Does not modify the cache."""
        return self.radix.match_prefix(prompt).num_tokens if self.config.prefix_cache else 0

    def prefix_hit_by_hashes(self, hashes: list[int]) -> int:
        """Leading pages held, given a peer's chained page hashes. Does not modify the cache."""
        return self.radix.match_hashes(hashes) if self.config.prefix_cache else 0

    def page_hashes(self, tokens: list[int]) -> list[int]:
        return chain_hashes(tokens, self.config.page_size)

    @property
    def num_pages_active(self) -> int:
        """Pages held by sequences (prefix-cache-only pages not counted)."""
        held = set()
        for s in self.seqs.values():
            held.update(s.pages.pages)
        return len(held)

    # ---- admission -------------------------------------------------------------------
    @property
    def max_sequence_tokens(self) -> int:
        """The most tokens (prompt + output) one request can ever hold: the whole pool but page 0."""
        return self.allocator.capacity * self.config.page_size

    def never_fits(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """One sentence if prompt + max_tokens exceed the whole pool (static: any thread may ask)."""
        if pages_needed(prompt_tokens + max_tokens, self.config.page_size) > self.allocator.capacity:
            return (f"prompt of {prompt_tokens} tokens plus max_tokens {max_tokens} can never fit this engine's KV "
                    f"pool ({self.max_sequence_tokens} tokens per request)")
        return None

    def add(self, seq_id: str, prompt: list[int], params: SamplingParams = GREEDY, max_tokens: int = 16,
            stop_ids=None, *, hold_on_finish: bool = False, use_cache: bool = True) -> Sequence:
        """Admit a sequence; returns it (`seq.pages.num_cached` = prefix-cache hit in tokens).
        Raises OutOfPages (nothing allocated) if prompt + max_tokens cannot be reserved now, and
        ValueError if they never can (more than `max_sequence_tokens`)."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        if params.penalised or params.logprobs or params.grammar is not None:
            params.validate(self.cfg.vocab_size)  # (the router checked the rest; bias ids need the vocabulary)
            if params.penalised and self.penalties is None:
                raise ValueError("penalties and logit_bias are not available on a multi-host instance")
        matcher = None
        if params.grammar is not None:
            if self.grammar is None:
                raise ValueError("constrained decoding needs the model's tokenizer: this engine has no grammar "
                                 "compiler")
            matcher = self.grammar.matcher(params.grammar)  # ValueError: a grammar llguidance refuses
        if not prompt or len(prompt) + max_tokens > self.cfg.max_context:
            raise ValueError(f"prompt of {len(prompt)} tokens plus {max_tokens} does not fit the context")
        S = self.config.page_size
        never = self.never_fits(len(prompt), max_tokens)
        if never:
            raise ValueError(never)
        cached_pages, node = [], None
        if use_cache and self.config.prefix_cache:
            m = self.radix.match_prefix(prompt)
            usable = min(m.num_tokens, (len(prompt) - 1) // S * S)  # keep >= 1 token to compute
            cached_pages, node = m.pages[: usable // S], m.last_node
            if cached_pages:
                self.radix.lock(node)
                self.radix.touch(node)
        need = pages_needed(len(prompt) + max_tokens, S) - len(cached_pages)
        try:
            fresh = self._allocate(need)
        except OutOfPages:
            if cached_pages:
                self.radix.unlock(node)
            raise
        self.allocator.incref(cached_pages)
        pages = SequencePages(S, cached_pages + fresh, len(cached_pages) * S, len(cached_pages) * S)
        seq = Sequence(seq_id, list(prompt), params, max_tokens,
                       frozenset(self.cfg.eos_token_ids if stop_ids is None else stop_ids), pages,
                       prefix_node=node if cached_pages else None, hold_on_finish=hold_on_finish,
                       table_width=self._table_width, matcher=matcher)
        seq.speculates = config_speculates(self.config) and speculate.can_draft(params)  # drafter: at its first decode
        self.seqs[seq_id] = seq
        return seq

    def _allocate(self, n: int) -> list[int]:
        while not self.allocator.can_allocate(n) and self.radix.num_evictable:
            self.radix.evict(n - self.allocator.num_free)
        return self.allocator.allocate(n)

    def import_kv(self, seq_id: str, run: KVRun | list[KVRun]) -> None:
        """Write KV computed elsewhere (one run, or the head pieces of one token range from a
        tensor-parallel sender); tokens this sequence already has are skipped."""
        seq = self.seqs[seq_id]
        have = seq.pages.num_tokens
        start, end = span(run)
        if start > have:
            raise KVImportError(f"KV for {seq_id} starts at token {start} but only {have} are present")
        if end > seq.num_tokens:
            raise KVImportError(f"KV for {seq_id} runs to token {end} past its {seq.num_tokens} known tokens")
        if end <= have:
            return
        self._write_kv(from_token(run, have), seq.pages.pages)
        seq.pages.num_tokens = end

    def _write_kv(self, run: KVRun | list[KVRun], pages: list[int]) -> None:
        """The device call of a KV import: `run` written into `pages`."""
        self.pool = self.layout.put_pool(import_run(self.pool, run, pages, self.fingerprint))

    def append_tokens(self, seq_id: str, start_pos: int, tokens: list[int]) -> None:
        """Output tokens produced elsewhere (RLD -> MD handoff), at output positions start_pos..."""
        self.seqs[seq_id].append_known(start_pos, tokens)

    # ---- the step --------------------------------------------------------------------
    def has_work(self) -> bool:
        return any(s.num_pending for s in self.seqs.values())

    def step(self) -> list[TokenEvent]:
        """Run one packed step over all sequences with pending tokens -> a TokenEvent per sampled row."""
        self._step_started = time.perf_counter()
        try:
            return self._step()
        finally:
            self._step_ended = time.perf_counter()

    def busy(self) -> bool:
        """A step in flight, or one ended under IDLE_GAP seconds ago (read from other threads: the
        background build waits for an idle engine before members no step asked for)."""
        started, ended = self._step_started, self._step_ended
        return started > ended or time.perf_counter() - ended < IDLE_GAP

    def _step(self) -> list[TokenEvent]:
        S, t0 = self.config.page_size, time.perf_counter()
        self.step_rows = None  # set once the rows are chosen: what a failing step fails
        # choose: the rows of this step and the member of the stated shape set they pad to
        rows, self._multi_first = buckets.pack_rows(
            self.shapes, self.config.pad_limit, self._pending(), self.config.max_step_tokens, self.config.max_rows,
            self._multi_first, S, lambda s: s.pages.num_tokens)
        if not rows:
            return []
        self.step_rows = [seq.seq_id for seq, _ in rows]  # row order: the sequences a failing step fails
        # drafts (speculative decoding): a drafted decode row runs as its k + 1 positions
        speculates = config_speculates(self.config)
        drafts = speculate.plan(rows, self.config.max_rows, self.config.max_step_tokens,
                                self.config.spec_max_tokens, self.step_costs) if speculates else {}
        run_rows, first = speculate.expand(rows, drafts) if drafts else (rows, range(len(rows)))
        width = max(pages_needed(seq.pages.num_tokens + n, S) for seq, n in run_rows)  # the widest page table
        tokens, q = sum(n for _, n in run_rows), max(n for _, n in run_rows)
        shape = buckets.fit(self.shapes, tokens, len(run_rows), width, q)
        if self.background is not None and len(self.shapes) < len(self.stated):
            self._ask_for_own(shape, run_rows, tokens, width, q)
        batch, sample_rows, greedy = self._build(run_rows, shape)
        pen = self.penalties.prepare(run_rows, sample_rows) if self.penalties is not None else None
        mask = step_batch.token_masks(run_rows, sample_rows, shape[1], self._mask_words)  # [B, W] or None
        sp = self._sampling_arrays(run_rows, shape[1], pen, mask)
        self.last_shape = (*shape, len(run_rows))
        # run: asynchronous on the device, so the KV bookkeeping below overlaps it
        tokens, lp = self._device_step(batch, sp, max_q_len=shape[3], greedy=greedy)  # [B], logprobs
        self.num_steps += 1
        for r, (seq, n) in enumerate(rows):
            if r not in drafts:
                seq.pages.num_tokens += n
        # update: each sampled row's token recorded (np.asarray waits for the step)
        tokens = np.asarray(tokens)
        if speculates and shape[3] == 1 and self.step_costs is not None:  # a decode-only step, by rows
            self.step_costs.observe(shape[1], time.perf_counter() - t0)
        asked = [r for r, (seq, _) in enumerate(run_rows) if sample_rows[r] and seq.params.logprobs]
        lp = jax.device_get(lp) if asked else None  # fetched only when a row wants them
        events = []
        for i, (seq, _) in enumerate(rows):
            r = first[i]
            if i in drafts:
                verified, accepted = speculate.accept(seq, drafts[i], tokens[r:r + len(drafts[i]) + 1])
                self.spec_drafted += len(drafts[i])
                self.spec_accepted += accepted
                events += verified
                if seq.finish_reason and not seq.hold_on_finish:
                    self.release(seq.seq_id)
                continue
            if not sample_rows[r]:
                continue
            pos = len(seq.generated)
            seq.record(int(tokens[r]))
            if pen is not None and pen[r] >= 0:
                self.penalties.counted(seq)
            if seq.finish_reason and seq.pen_row >= 0:
                self.penalties.free(seq)
            logprobs = _logprobs(lp, r, seq.params.top_logprobs) if lp is not None and seq.params.logprobs else None
            events.append(TokenEvent(seq.seq_id, pos, int(tokens[r]), seq.finish_reason, logprobs))
            if seq.finish_reason and not seq.hold_on_finish:
                self.release(seq.seq_id)
        return events

    def _pending(self) -> list[Sequence]:
        """Sequences with pending tokens; no more of them penalised than the penalty tables have
        rows (those holding a row first, then in arrival order; the rest wait)."""
        pending = [s for s in self.seqs.values() if s.num_pending]
        rows = self.penalties.tables.rows if self.penalties is not None else 0
        if not rows or len(pending) <= rows:
            return pending
        pen = [s for s in pending if s.params.penalised]
        if len(pen) <= rows:
            return pending
        keep = {id(s) for s in sorted(pen, key=lambda s: (s.pen_row < 0, self.penalties.used_by(s)))[:rows]}
        return [s for s in pending if not s.params.penalised or id(s) in keep]

    def _ask_for_own(self, shape: buckets.Shape, run_rows, tokens: int, width: int, q: int) -> None:
        """While the background build runs: ask it for the members this step would have taken
        with the whole set built (it padded past them), and for a lone row cut short, the
        member that holds the rest of it (`BackgroundBuild.want`: built next)."""
        own = buckets.fit(self.stated, tokens, len(run_rows), width, q)
        if own != shape:
            self.background.want(own)
        seq, n = run_rows[0]
        if len(run_rows) == 1 and 1 < n < seq.num_pending:
            rest = min(seq.num_pending, self.config.max_step_tokens)
            whole = buckets.fit(self.stated, rest, 1, pages_needed(seq.pages.num_tokens + rest, self.config.page_size),
                                rest)
            if whole is not None and whole not in self.shapes:
                self.background.want(whole)

    def _device_step(self, batch, sampling: tuple, *, max_q_len: int, greedy: bool):
        """The device call of a step: forward + sample, the pool (and penalty tables) advanced
        -> (tokens [B], logprobs: `step.StepOut.logprobs`)."""
        tables = self.penalties.tables if self.penalties is not None else None
        out = run(self.weights, self.cfg, batch, self.pool, sampling, tables, max_q_len=max_q_len,
                  impl=self.config.attention, greedy=greedy, layout=self.layout)
        self.pool = out.pool
        if self.penalties is not None:
            self.penalties.tables = out.tables
        return out.tokens, out.logprobs

    def _build(self, rows, shape: buckets.Shape):
        return step_batch.build(rows, shape, self.config.page_size)

    @staticmethod
    def _sampling_arrays(rows, B, pen_rows=None, mask=None):
        return step_batch.sampling_arrays(rows, B, pen_rows, mask)

    def precompile(self, ready: str = "all", clock=None) -> tuple[int, float]:
        """Build the stated set's step variants ("all"; "cover": a covering few, the rest in the
        background) and the KV copies' token buckets before serving -> (variants, seconds). See
        `pddjax.engines.precompile`."""
        from pddjax.engines.precompile import precompile

        built = precompile(self, ready, clock)
        if self.penalties is not None:
            self.penalties.build()  # the penalty rows' seed program
        return built

    # ---- KV out, release -------------------------------------------------------------
    def export_kv(self, seq_id: str, start: int = 0, end: int | None = None) -> KVRun:
        """Canonical KV of tokens [start, end) (default: all computed tokens), all heads in one run."""
        return join_heads(self.export_kv_shards(seq_id, start, end))

    def export_kv_shards(self, seq_id: str, start: int = 0, end: int | None = None) -> list[KVRun]:
        """As export_kv, one piece per distinct KV head range of the pool's shards (each read
        from its own device; a replicated pool gives one piece of all heads): what P sends."""
        seq = self.seqs[seq_id]
        end = seq.pages.num_tokens if end is None else end
        if not 0 <= start <= end <= seq.pages.num_tokens:
            raise ValueError(f"cannot export tokens [{start}, {end}) of {seq_id}: {seq.pages.num_tokens} computed")
        return self._read_kv(seq.pages.pages, start, end)

    def _read_kv(self, pages: list[int], start: int, end: int) -> list[KVRun]:
        """The device call of a KV export: tokens [start, end) of `pages`, one piece per head range."""
        return export_shards(self.pool, pages, start, end, self.fingerprint)

    def cache_prefix(self, seq_id: str) -> None:
        """Insert a live sequence's computed full pages into the prefix cache (if on) now; the
        sequence keeps its own references (P: its cache serves a prompt at once while the pages
        are still held for a peer's transfer). Pages already cached are not taken twice."""
        seq = self.seqs[seq_id]
        done = seq.pages.num_tokens // self.config.page_size * self.config.page_size
        if self.config.prefix_cache and done:
            self.radix.insert(seq.all_tokens()[:done], seq.pages.pages)

    def release(self, seq_id: str, cache: bool = True) -> None:
        """Drop a sequence; its computed full pages go into the prefix cache first (if on)."""
        if cache:
            self.cache_prefix(seq_id)
        seq = self.seqs.pop(seq_id)
        if self.penalties is not None:
            self.penalties.free(seq)
        if seq.prefix_node is not None:
            self.radix.unlock(seq.prefix_node)
        self.allocator.decref(seq.pages.pages)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        self.radix.check_integrity()
        owners: dict[int, int] = {}
        for s in self.seqs.values():
            s.pages.check_integrity()
            if s.matcher is not None:
                s.matcher.check_integrity(len(s.generated))
            if s.drafter is not None:
                s.drafter.check_integrity()
                assert s.drafter.tokens == s.all_tokens()[:len(s.drafter)], f"{s.seq_id}: drafter context differs"
            assert s.pages.num_tokens <= s.num_tokens, f"{s.seq_id}: more KV than tokens"
            n = len(s.pages.pages)
            assert s.page_array[:n].tolist() == s.pages.pages and not s.page_array[n:].any(), \
                f"{s.seq_id}: its page_array (the step's page table row) differs from its pages"
            for p in s.pages.pages:
                owners[p] = owners.get(p, 0) + 1
        for p, n in owners.items():
            assert self.allocator.refcount(p) >= n, f"page {p} has fewer refs than holders"
        cached = self.radix.cached_pages()
        expected_used = set(owners) | cached
        assert self.allocator.num_used == len(expected_used), "pages leaked: used pages with no holder"
        if self.penalties is not None:
            self.penalties.check_integrity(self.seqs)


def config_speculates(config: EngineConfig) -> bool:
    return config.speculative != "off"


def _logprobs(lp, r: int, top: int) -> TokenLogprobs:
    """Row r of a step's fetched logprobs (chosen [B], top ids [B, 20], top logprobs [B, 20])."""
    chosen, ids, vals = lp
    return TokenLogprobs(float(chosen[r]), tuple(zip(ids[r, :top].tolist(), vals[r, :top].tolist())))
