"""llguidance's view of a pddjax tokenizer: every token id's bytes, which ids are special, the EOS ids.

Built from the `tokenizers.Tokenizer` inside a `TextTokenizer` (`GGUFTokenizer` for a GGUF model
such as SmolLM2, `HFTokenizer` for a checkpoint directory): its JSON is what llguidance reads, so
byte-level BPE symbols map back to raw bytes (a token need not be valid UTF-8 alone: llguidance
matches bytes, a multi-byte character may span tokens) and added special tokens stay special (a
mask never allows them, except the EOS ids, which it allows exactly when the grammar can end).

The mask covers the model's vocabulary (`vocab_size`, which may exceed the tokenizer's: ids past
it have no bytes and are never allowed): ceil(vocab_size / 32) int32 words per row.
"""

from __future__ import annotations

import hashlib


def mask_words(vocab_size: int) -> int:
    """int32 words of one packed mask row: bit j of word i is token 32 * i + j."""
    return (vocab_size + 31) // 32


class GrammarTokenizer:
    """An `llguidance.LLTokenizer` with the vocabulary size the masks cover and a stable `key`."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids):
        import llguidance

        eos = [int(t) for t in eos_ids]
        if not eos or any(not 0 <= t < vocab_size for t in eos):
            raise ValueError(f"constrained decoding needs EOS token ids in [0, {vocab_size}), got {eos}")
        try:
            self.ll = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        except Exception as e:  # llguidance raises its own error types on a tokenizer it cannot read
            raise ValueError(f"llguidance cannot read this tokenizer: {e}") from None
        if self.ll.vocab_size != vocab_size:
            raise ValueError(f"the tokenizer has {self.ll.vocab_size} tokens, the model's vocabulary {vocab_size}")
        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        self.eos_ids = tuple(eos)
        digest = hashlib.sha256(tokenizer_json.encode("utf-8", "surrogatepass"))
        digest.update(f"\0{vocab_size}\0{self.eos_ids}".encode())
        self.key = digest.hexdigest()

    @classmethod
    def of(cls, text_tokenizer, vocab_size: int, eos_ids=None) -> GrammarTokenizer:
        """From a `pddjax.model.tokenizer.TextTokenizer` (GGUF or HF); EOS: `eos_ids` (the model's
        stop ids, `ModelConfig.eos_token_ids`) or the tokenizer's own."""
        if eos_ids is None:
            eos_ids = () if text_tokenizer.eos_id is None else (text_tokenizer.eos_id,)
        return cls(text_tokenizer.tok.to_str(), vocab_size, eos_ids)

    def token_bytes(self, ids) -> bytes:
        """The bytes of token ids (special tokens as their text)."""
        return self.ll.decode_bytes(list(ids))

    def encode(self, text: str) -> list[int]:
        """`text`'s token ids as the tokenizer splits it (special-token text stays plain)."""
        return self.ll.tokenize_str(text)

    def is_special(self, token: int) -> bool:
        return self.ll.is_special_token(token)
