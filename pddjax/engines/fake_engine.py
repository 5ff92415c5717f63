"""A fake engine whose outputs can be checked by hand, for testing serving layers fast.

Rule: the token after a sequence s is (s[-1] + 1) % vocab, whatever the sampling params
(so every engine, and every handoff, agrees by construction). "KV" of the token at position
p is the array [[[token]]] per layer: importing checks it, so a corrupted or misplaced run
is caught. Prefix cache: exact page-aligned prompt prefixes of released sequences.
"""

from __future__ import annotations

import numpy as np

from pddjax.engines.engine_api import Engine, TokenEvent
from pddjax.engines.sequence import Sequence
from pddjax.kv.canonical import KVImportError, KVRun
from pddjax.kv.page_hash import chain_hashes
from pddjax.kv.page_table import SequencePages


class FakeEngine(Engine):
    def __init__(self, vocab_size: int = 1000, page_size: int = 4, fingerprint: str = "fake", num_layers: int = 2):
        self.vocab_size, self.page_size = vocab_size, page_size
        self.fingerprint, self.num_layers = fingerprint, num_layers
        self.seqs: dict[str, Sequence] = {}
        self.kv: dict[str, list[int]] = {}  # seq_id -> tokens whose "KV" exists
        self.cache: set[int] = set()  # chained page hashes held
        self.num_steps = 0

    def next_token(self, tokens: list[int]) -> int:
        return (tokens[-1] + 1) % self.vocab_size

    def page_hashes(self, tokens):
        return chain_hashes(tokens, self.page_size)

    def prefix_hit(self, prompt) -> int:
        n = 0
        for h in self.page_hashes(prompt[:-1]):
            if h not in self.cache:
                break
            n += self.page_size
        return n

    def prefix_hit_by_hashes(self, hashes) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n

    def add(self, seq_id, prompt, params, max_tokens, stop_ids=None, *, hold_on_finish=False, use_cache=True):
        hit = self.prefix_hit(prompt) if use_cache else 0
        pages = SequencePages(self.page_size, [], hit, hit)
        seq = Sequence(seq_id, list(prompt), params, max_tokens, frozenset(stop_ids or ()), pages,
                       hold_on_finish=hold_on_finish)
        self.seqs[seq_id], self.kv[seq_id] = seq, list(prompt[:hit])
        return seq

    def import_kv(self, seq_id, run: KVRun) -> None:
        seq, have = self.seqs[seq_id], self.kv[seq_id]
        if run.fingerprint != self.fingerprint:
            raise KVImportError(f"KV was computed by model {run.fingerprint}, this engine serves {self.fingerprint}")
        if run.start > len(have):
            raise KVImportError(f"KV for {seq_id} starts at token {run.start} but only {len(have)} are present")
        toks = [int(x) for x in run.k[0, :, 0, 0]]
        if toks != [seq.token_at(p) for p in range(run.start, run.end)]:
            raise KVImportError(f"KV for {seq_id} does not belong to its tokens")
        self.kv[seq_id] = have[: run.start] + toks if run.end > len(have) else have
        seq.pages.num_tokens = len(self.kv[seq_id])

    def append_tokens(self, seq_id, start_pos, tokens) -> None:
        self.seqs[seq_id].append_known(start_pos, tokens)

    def has_work(self) -> bool:
        return any(s.num_pending for s in self.seqs.values())

    def step(self) -> list[TokenEvent]:
        events = []
        for seq in [s for s in self.seqs.values() if s.num_pending]:
            self.kv[seq.seq_id] = seq.all_tokens()
            seq.pages.num_tokens = seq.num_tokens
            pos = len(seq.generated)
            seq.record(self.next_token(seq.all_tokens()))
            events.append(TokenEvent(seq.seq_id, pos, seq.generated[-1], seq.finish_reason))
            if seq.finish_reason and not seq.hold_on_finish:
                self.release(seq.seq_id)
        self.num_steps += bool(events)
        return events

    def export_kv(self, seq_id, start=0, end=None) -> KVRun:
        have = self.kv[seq_id]
        end = len(have) if end is None else end
        k = np.zeros((self.num_layers, end - start, 1, 1), np.float32)
        k[:, :, 0, 0] = have[start:end]
        return KVRun(self.fingerprint, start, k, k.copy(), "float32")

    def release(self, seq_id, cache=True) -> None:
        self.seqs.pop(seq_id)
        tokens = self.kv.pop(seq_id)
        if cache:
            self.cache.update(self.page_hashes(tokens))

    def check_integrity(self) -> None:
        for sid, s in self.seqs.items():
            assert self.kv[sid] == s.all_tokens()[: len(self.kv[sid])], f"{sid}: KV does not match tokens"
