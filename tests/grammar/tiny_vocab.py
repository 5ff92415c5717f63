"""The tiny random model's tokenizer (tests/support/gguf_factory.py's 512-token byte-level BPE,
built from its GGUF metadata without writing a file) and a grammar compiler over it, shared by
the grammar and engine tests. Tokens: 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|> (special;
2 is the tiny model's EOS), 3..258 the 256 bytes, then a few merges and "<unusedN>" fillers."""

from __future__ import annotations

import functools

from tests.support.gguf_factory import vocab

VOCAB = 512
EOS = 2


class _Field:
    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


class _Reader:
    """What GGUFTokenizer.from_reader reads: the `tokenizer.ggml.*` fields."""

    def __init__(self, size: int):
        tokens, types, merges = vocab(size)
        values = {"model": "gpt2", "tokens": tokens, "token_type": types, "merges": merges, "pre": "smollm",
                  "bos_token_id": 1, "eos_token_id": EOS, "add_bos_token": False}
        self.fields = {f"tokenizer.ggml.{k}": _Field(v) for k, v in values.items()}


@functools.cache
def text_tokenizer():
    from pddjax.model.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_reader(_Reader(VOCAB))


@functools.cache
def grammar_tokenizer():
    from pddjax.grammar.tokenizer import GrammarTokenizer

    return GrammarTokenizer.of(text_tokenizer(), VOCAB, (EOS,))


def compiler(timeout_s: float | None = None):
    from pddjax.grammar.compiler import COMPILE_SECONDS, GrammarCompiler

    return GrammarCompiler(grammar_tokenizer(), COMPILE_SECONDS if timeout_s is None else timeout_s)
