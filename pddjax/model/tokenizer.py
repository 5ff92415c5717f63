"""Tokenizers over the `tokenizers` library: the shared `TextTokenizer` and the GGUF one.

`TextTokenizer` wraps a `tokenizers.Tokenizer` with its BOS/EOS, chat template (rendered in
jinja2's sandbox) and `encode_chat`, which keeps special-token text typed inside messages plain
(`chat_template.py`). `GGUFTokenizer` builds one from a GGUF's own metadata: vocabulary, merges,
token types and special tokens from `tokenizer.ggml.*`, the pre-tokenizer following
`tokenizer.ggml.pre` the way llama.cpp does (e.g. `smollm` splits digits one by one before GPT-2
byte-level splitting, `qwen2` uses Qwen2's regex). A checkpoint directory's tokenizer.json:
`hf_tokenizer.py`.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from pddjax.model import chat_template, gguf_meta

# GGUF token types (gguf.TokenType)
_CONTROL, _USER_DEFINED = 3, 4
# llama.cpp pre-tokenizer names that split every digit before the GPT-2 regex.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_PRE = {"llama-bpe", "llama3", "smaug-bpe"}
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PRE = {"qwen2"}
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class TextTokenizer:
    """A `tokenizers.Tokenizer` with its special ids and chat template.

    post_process: `encode` applies tokenizer.json's post-processor (HF's add_special_tokens=True,
    e.g. Llama 3's BOS); otherwise a BOS is prepended only when `add_bos`."""

    def __init__(self, tok: Tokenizer, *, bos_id, eos_id, add_bos: bool, chat_template: str | None,
                 post_process: bool = False, template_vars: dict[str, str] | None = None):
        self.tok = tok
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.post_process = post_process
        self._template_vars = template_vars
        self._plain = None  # the same tokenizer with special-token matching off (built on first use)
        self.special_ids = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of raw `text` (special-token text in it IS special: the caller wrote it all)."""
        ids = self.tok.encode(text, add_special_tokens=self.post_process).ids
        if self.add_bos and self.bos_id is not None and not self.post_process:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        return self.tok.id_to_token(token_id)

    def template_vars(self) -> dict[str, str]:
        if self._template_vars is not None:
            return self._template_vars
        text = lambda i: self.token_text(i) if i is not None else ""  # noqa: E731
        return {"bos_token": text(self.bos_id), "eos_token": text(self.eos_id)}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tools: list[dict] | None = None) -> str:
        """Render `messages` ([{"role", "content"}, + tool_calls / role "tool"]) and `tools` with the chat
        template, in jinja2's sandbox (tools a template does not read: `chat_template.with_tools`)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        return chat_template.render(self.chat_template, messages, add_generation_prompt, self.template_vars(), tools)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids of the rendered chat; special-token text inside the messages and tools stays plain text."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        ids = chat_template.encode_chat(self.chat_template, messages, add_generation_prompt, self.template_vars(),
                                        self.special_ids, self._encode_plain, tools)
        if self.add_bos and self.bos_id is not None and not self.post_process and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def _encode_plain(self, text: str, first: bool) -> list[int]:
        if self._plain is None:
            self._plain = (_plain_copy(self.tok.to_str(), first=True), _plain_copy(self.tok.to_str(), first=False))
        return self._plain[0 if first else 1].encode(text, add_special_tokens=False).ids


def _plain_copy(spec: str, first: bool) -> Tokenizer:
    """The tokenizer of JSON `spec` with special-token matching off; unless `first`, a Metaspace
    prepend_scheme "first" becomes "never" (it applies only where the whole input starts)."""
    d = json.loads(spec)

    def visit(node):
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first" and not first:
                node["prepend_scheme"] = "never"
            for v in node.values():
                visit(v)
        elif isinstance(node, list):
            for v in node:
                visit(v)

    visit(d.get("pre_tokenizer"))
    tok = Tokenizer.from_str(json.dumps(d))
    tok.encode_special_tokens = True
    return tok


class GGUFTokenizer(TextTokenizer):
    def __init__(self, tok: Tokenizer, *, bos_id, eos_id, add_bos: bool, chat_template: str | None, id_to_token):
        super().__init__(tok, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos, chat_template=chat_template)
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
        elif pre in _QWEN2_PRE:
            tok.normalizer = normalizers.NFC()
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
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

    def token_text(self, token_id: int) -> str:
        return self._id_to_token[token_id]
