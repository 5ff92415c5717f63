"""The load `bench serve --peer` sends through both clients: a trace as text prompts at fixed times.

A peer client sends text, so the trace's token ids become text that the server's tokenizer turns
back into the same ids: every id maps to a *word* token (`WordMap`: a vocabulary entry that is a
space and two or more ASCII lowercase letters and encodes back to itself alone; byte-level BPE splits
such text at the spaces, so a run of them encodes to exactly those ids, `check` confirms it).
The ids come from `TokenBuilder` (the trace's docs, shared prefixes, new tokens, and the trace's
synthetic outputs in place of the model's: the load is fixed before it is sent), and the first id of
every prompt becomes the run's *salt* word, so each run's prompts share no cached page with another
run's (page hashes chain from the first token) while keeping their lengths and their shared prefixes
within the run.

`build` -> (history, measured): the trace's turns with arrival_s < 0 (sent unmeasured first, as
`bench serve` does, to warm the caches) and the measured turns, each `LoadItem` at its arrival time
(ms after the measured phase starts), with `max_tokens` = the trace's output length (sent with
`ignore_eos`). `write_aiperf` writes the measured items as AIPerf's `single_turn` JSONL (`text`,
`timestamp` in ms, `output_length`), which `--fixed-schedule` sends at those times.
"""

from __future__ import annotations

import dataclasses
import json
import re

from pddjax.workload import TokenBuilder

WORD = re.compile(r"\u0120[a-z]{2,}")  # byte-level BPE's leading space, then a lowercase ASCII word


@dataclasses.dataclass(frozen=True)
class LoadItem:
    request_id: str
    session_id: int
    turn: int
    at_ms: float  # send time after the measured phase starts (history items: their trace arrival, < 0)
    ids: tuple[int, ...]  # what the server's tokenizer makes of `text`
    text: str
    max_tokens: int


class WordMap:
    """Token id -> word token id of `tokenizer` (a pddjax `TextTokenizer`), and ids <-> text."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        words = [i for i in range(tokenizer.vocab_size) if WORD.fullmatch(tokenizer.token_text(i) or "")]
        self.words = [i for i in words if self._plain_encode(tokenizer.decode([i])) == [i]]
        if len(self.words) < 256:
            raise ValueError(f"the tokenizer has {len(self.words)} word tokens (a text load needs >= 256)")

    def _plain_encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text)
        return ids[1:] if self.tok.add_bos and ids[:1] == [self.tok.bos_id] else ids

    def word(self, token_id: int) -> int:
        return self.words[token_id % len(self.words)]

    def text(self, ids) -> str:
        return self.tok.decode(list(ids))

    def check(self, item: LoadItem) -> None:
        """Raise ValueError unless the server's tokenizer turns `item.text` back into `item.ids`."""
        got = self._plain_encode(item.text)
        if got != list(item.ids):
            at = next((k for k, (a, b) in enumerate(zip(got, item.ids)) if a != b), min(len(got), len(item.ids)))
            raise ValueError(f"{item.request_id}: the text does not encode back to its ids (first difference at {at})")


def build(trace, trace_seed: int, words: WordMap, salt: int) -> tuple[list[LoadItem], list[LoadItem]]:
    """-> (history items in session / turn order, measured items by send time) of run `salt`."""
    builder = TokenBuilder(trace_seed, words.tok.vocab_size)
    salt_id = words.words[salt % len(words.words)]
    history, measured = [], []
    for req in sorted(trace, key=lambda r: (r.session_id, r.turn)):
        ids = [salt_id] + [words.word(t) for t in builder.prompt_ids(req)[1:]]
        item = LoadItem(req.request_id, req.session_id, req.turn, round(1e3 * req.arrival_s, 3), tuple(ids),
                        words.text(ids), req.max_tokens)
        (history if req.arrival_s < 0 else measured).append(item)
    measured.sort(key=lambda it: (it.at_ms, it.request_id))
    return history, measured


def write_aiperf(items: list[LoadItem], path: str) -> None:
    """AIPerf's `single_turn` JSONL: one independent request per line at `timestamp` ms."""
    with open(path, "w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps({"text": it.text, "timestamp": it.at_ms, "output_length": it.max_tokens}) + "\n")


def read_aiperf(path: str) -> list[dict]:
    """The rows of a `write_aiperf` file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
