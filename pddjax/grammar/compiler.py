"""Compile a `GrammarSpec` for one tokenizer, once: a bounded LRU keyed by (tokenizer, spec hash).

`GrammarCompiler.compile(spec)` turns the spec into llguidance's grammar (JSON schema, regex or
Lark), validates it against the tokenizer and builds the parser (a `llguidance.LLMatcher` kept
as a template, its first mask computed so the lexer is built) -> `Compiled`; `matcher(spec)` is
a fresh per-sequence `Matcher` (a copy of the template: microseconds). What llguidance refuses
is a ValueError naming the part ("json_schema is not supported: Unimplemented keys: ["not"]");
a compile past `timeout_s` (default COMPILE_SECONDS) is refused as too large. Thread-safe: the
serving layer compiles in a worker thread, off its event loop, and the engine thread then finds
the grammar cached. llguidance drops the GIL while it builds.

The cache is process-wide (`CACHE_SIZE` grammars, least recently used dropped first), so every
engine of a process with the same tokenizer shares it.
"""

from __future__ import annotations

import collections
import re
import threading
import time
from typing import NamedTuple

import llguidance
import numpy as np

from pddjax.grammar.matcher import Matcher
from pddjax.grammar.spec import GrammarSpec
from pddjax.grammar.tokenizer import GrammarTokenizer

CACHE_SIZE = 256  # compiled grammars held per process
COMPILE_SECONDS = 5.0  # a grammar that takes longer to build is refused
# JSON as json.dumps writes it: one space after "," and ":", no other whitespace (a weak model
# otherwise fills the output with whitespace the grammar allows); a schema's "x-guidance" may differ
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Compiled(NamedTuple):
    spec: GrammarSpec
    template: llguidance.LLMatcher  # never advanced: each sequence gets a deep copy
    seconds: float  # the build's wall time


class _Cache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._lru: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.builds = 0  # grammars compiled in this process

    def get(self, key):
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
            return hit

    def put(self, key, value) -> None:
        with self._lock:
            self.builds += 1
            self._lru[key] = value
            while len(self._lru) > self.capacity:
                self._lru.popitem(last=False)

    def __len__(self) -> int:
        return len(self._lru)

    def check_integrity(self) -> None:
        assert len(self._lru) <= self.capacity, f"{len(self._lru)} grammars held, capacity {self.capacity}"


_cache = _Cache(CACHE_SIZE)


def cache() -> _Cache:
    return _cache


def _grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for the spec (not yet checked)."""
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=JSON_OPTIONS)
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    return llguidance.LLMatcher.grammar_from_lark(spec.text)


class GrammarCompiler:
    def __init__(self, tokenizer: GrammarTokenizer, timeout_s: float = COMPILE_SECONDS):
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s

    def compile(self, spec: GrammarSpec) -> Compiled:
        """The compiled grammar (cached, or built now). ValueError: a bad spec, one llguidance
        refuses, or one that takes longer than `timeout_s` to build."""
        if not isinstance(spec, GrammarSpec):
            raise ValueError(f"a grammar must be a GrammarSpec, got {type(spec).__name__}")
        key = (self.tokenizer.key, spec.key)
        hit = _cache.get(key)
        if hit is not None:
            return hit
        spec.validate()
        compiled = self._build(spec)
        _cache.put(key, compiled)
        return compiled

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A fresh matcher at the grammar's start, for one sequence."""
        c = self.compile(spec)
        tok = self.tokenizer
        return Matcher(c.template.deep_copy(), tok.words, spec.kind, tok.eos_ids)

    def _build(self, spec: GrammarSpec) -> Compiled:


        result: list = []

        def build():  # in its own thread, so a runaway build is abandoned at the time bound
            t0 = time.perf_counter()
            try:
                grammar = _grammar_text(spec)
                failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer.ll)
                if failed:
                    result.append(ValueError(f"{spec.kind} is not supported: {_first_line(messages)}"))
                    return
                m = llguidance.LLMatcher(self.tokenizer.ll, grammar, log_level=0)
                if m.is_error():
                    result.append(ValueError(f"{spec.kind} is not supported: {_first_line([m.get_error()])}"))
                    return
                scratch = np.zeros(self.tokenizer.words, np.int32)  # [W]
                m.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)  # builds the lexer's first states
                if m.is_error():
                    result.append(ValueError(f"{spec.kind} cannot start: {_first_line([m.get_error()])}"))
                    return
                m.reset()
                result.append(Compiled(spec, m, time.perf_counter() - t0))
            except ValueError as e:  # llguidance: the schema is not JSON
                result.append(ValueError(f"{spec.kind} is not valid: {e}"))

        t = threading.Thread(target=build, name="grammar-compile", daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive() or not result:
            raise ValueError(f"the {spec.kind} grammar is too large: it did not compile within {self.timeout_s:g} s")
        if isinstance(result[0], Exception):
            raise result[0]
        return result[0]


def _first_line(messages, limit: int = 300) -> str:
    """llguidance's message on one line: its text lines joined, the source excerpts (`1 | ...`,
    `^`) left out, at most `limit` characters."""
    text = next((m for m in messages if m), "refused")
    lines = [ln.strip() for ln in text.split("\n")]
    kept = " ".join(ln for ln in lines if ln and not re.match(r"\d+ \|", ln) and set(ln) != {"^"})
    return kept if len(kept) <= limit else kept[:limit - 3] + "..."
