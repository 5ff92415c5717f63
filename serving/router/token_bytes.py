"""Each token's exact bytes, for logprobs (OpenAI's `bytes`: a token that holds part of a UTF-8
character decodes alone to U+FFFD, its bytes do not).

`build(tokenizer)` reads the tokenizer's vocabulary through llguidance (pddjax/grammar/tokenizer.py:
~0.3 s for a 49k vocabulary, so the router runs it in a worker thread at start, off its event
loop); `get(tokenizer)` is then `token_bytes(ids) -> bytes` (under a microsecond a call), None
before that or for a model without a tokenizer: the router falls back to the decoded text's
UTF-8.
"""

from __future__ import annotations

import threading

_built: dict[int, tuple] = {}  # id(tokenizer) -> (tokenizer, its token_bytes)
_lock = threading.Lock()


def build(tokenizer) -> None:
    if tokenizer is None or get(tokenizer) is not None:
        return
    from pddjax.grammar.tokenizer import GrammarTokenizer

    fn = GrammarTokenizer.of(tokenizer, tokenizer.vocab_size).token_bytes
    with _lock:
        _built[id(tokenizer)] = (tokenizer, fn)


def get(tokenizer):
    with _lock:
        held = _built.get(id(tokenizer))
    return held[1] if held is not None and held[0] is tokenizer else None
