"""Tokenizer built from the GGUF's own metadata with the `tokenizers` library.

Vocabulary, merges, token types and special tokens come from `tokenizer.ggml.*`; the
pre-tokenizer follows `tokenizer.ggml.pre` the way llama.cpp does (e.g. `smollm` splits digits
one by one before GPT-2 byte-level splitting). The chat template is the GGUF's Jinja template.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from pddjax.model import gguf_meta

# GGUF token types (gguf.TokenType)
_CONTROL, _USER_DEFINED = 3, 4
# llama.cpp pre-tokenizer names that split every digit before the GPT-2 regex.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_PRE = {"llama-bpe", "llama3", "smaug-bpe"}
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class GGUFTokenizer:
    def __init__(self, tok: Tokenizer, *, bos_id, eos_id, add_bos: bool, chat_template: str | None, id_to_token):
        self.tok = tok
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._id_to_token = id_to_token

    @classmethod
    def from_reader(cls, reader) -> GGUFTokenizer:
        f = lambda k, d=None: gguf_meta.field(reader, k, d)  # noqa: E731
        model = f("tokenizer.ggml.model")
        if model != "gpt2":
            raise gguf_meta.GGUFError(f"unsupported GGUF tokenizer model {model!r} (supported: gpt2 byte-level BPE)")
        tokens = [str(t) for t in f("tokenizer.ggml.tokens")]
        types = list(f("tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = [tuple(m.split(" ", 1)) for m in f("tokenizer.ggml.merges", [])]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        pre = f("tokenizer.ggml.pre", "default")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in _DIGIT_SPLIT_PRE:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre in _LLAMA3_PRE:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(types) if t == _CONTROL]
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(types) if t == _USER_DEFINED]
        tok.add_special_tokens(special)
        tok.add_tokens(user)
        bos, eos = f("tokenizer.ggml.bos_token_id"), f("tokenizer.ggml.eos_token_id")
        return cls(tok, bos_id=None if bos is None else int(bos), eos_id=None if eos is None else int(eos),
                   add_bos=bool(f("tokenizer.ggml.add_bos_token", False)),
                   chat_template=f("tokenizer.chat_template"), id_to_token=tokens)

    def to_json(self) -> dict:
        """Everything needed to rebuild this tokenizer without reading the GGUF again."""
        return {"tokenizer": self.tok.to_str(), "bos_id": self.bos_id, "eos_id": self.eos_id,
                "add_bos": self.add_bos, "chat_template": self.chat_template}

    @classmethod
    def from_json(cls, d: dict) -> GGUFTokenizer:
        tok = Tokenizer.from_str(d["tokenizer"])
        tokens = [tok.id_to_token(i) for i in range(tok.get_vocab_size(with_added_tokens=True))]
        return cls(tok, bos_id=d["bos_id"], eos_id=d["eos_id"], add_bos=d["add_bos"],
                   chat_template=d["chat_template"], id_to_token=tokens)

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_token)

    def encode(self, text: str) -> list[int]:
        """Token IDs of `text`; a BOS is prepended only if the GGUF says `add_bos_token`."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        return self._id_to_token[token_id]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role", "content"}]) with the GGUF's Jinja chat template."""
        if not self.chat_template:
            raise ValueError("this GGUF has no chat template")
        import jinja2

        env = jinja2.Environment(trim_blocks=False, lstrip_blocks=False, keep_trailing_newline=True)
        template = env.from_string(self.chat_template)
        tokens = self._id_to_token
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=tokens[self.bos_id] if self.bos_id is not None else "",
            eos_token=tokens[self.eos_id] if self.eos_id is not None else "")
