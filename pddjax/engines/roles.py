"""The three PDD roles over one PagedEngine each.

- PrefillEngine (P): prefills a batch of prompts (own prefix cache, chunked by the step
  budget), samples each first token, and holds the pages until the KV is exported.
- DecodeEngine (RLD and MD): admits sequences whose KV arrives from elsewhere (on MD on top
  of its decode-side radix cache, DRC), takes handed-over token IDs as extend rows in the same
  batch as ordinary decode rows, and streams tokens.
"""

from __future__ import annotations

import dataclasses

from pddjax.engines.paged_engine import PagedEngine, TokenEvent
from pddjax.kv.canonical import KVRun
from pddjax.model.sampling import SamplingParams


@dataclasses.dataclass
class PrefillRequest:
    seq_id: str
    prompt: list[int]
    params: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] | None = None


@dataclasses.dataclass
class PrefillResult:
    seq_id: str
    first_token: int
    num_prompt: int
    num_cached: int  # prompt tokens P's prefix cache supplied (not recomputed)
    finish_reason: str | None  # "stop" if the first token already ends the request


class PrefillEngine(PagedEngine):
    def prefill(self, requests: list[PrefillRequest]) -> list[PrefillResult]:
        """Prefill all requests together; their KV stays held until `release`."""
        cached = {}
        for r in requests:
            seq = self.add(r.seq_id, r.prompt, r.params, max_tokens=1, stop_ids=r.stop_ids, hold_on_finish=True)
            cached[r.seq_id] = seq.pages.num_cached
        while any(not self.seqs[r.seq_id].generated for r in requests):
            self.step()
        out = []
        for r in requests:
            seq = self.seqs[r.seq_id]
            reason = "stop" if seq.generated[0] in seq.stop_ids else None
            out.append(PrefillResult(r.seq_id, seq.generated[0], len(r.prompt), cached[r.seq_id], reason))
        return out


class DecodeEngine(PagedEngine):
    def admit(self, seq_id: str, prompt: list[int], known_tokens: list[int], kv: KVRun | None,
              params: SamplingParams, max_tokens: int, stop_ids=None, use_cache: bool = True) -> int:
        """Admit a sequence whose prompt KV comes from P (`kv` may start past this engine's own
        cache hit) and whose first output tokens are already known. Returns the cache hit."""
        seq = self.add(seq_id, prompt, params, max_tokens, stop_ids, use_cache=use_cache)
        try:
            if kv is not None:
                self.import_kv(seq_id, kv)
            if known_tokens:
                self.append_tokens(seq_id, 0, known_tokens)
        except Exception:
            self.release(seq_id, cache=False)
            raise
        return seq.pages.num_cached

    def run_until_done(self, seq_ids: list[str] | None = None) -> dict[str, list[TokenEvent]]:
        """Step until the given (default: all) sequences finish; events per sequence."""
        out: dict[str, list[TokenEvent]] = {}
        wanted = set(self.seqs if seq_ids is None else seq_ids)
        while any(s in self.seqs and self.seqs[s].num_pending for s in wanted):
            for ev in self.step():
                out.setdefault(ev.seq_id, []).append(ev)
        return out
