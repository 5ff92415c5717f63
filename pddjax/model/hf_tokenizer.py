"""A checkpoint directory's tokenizer: tokenizer.json (the `tokenizers` library), its special tokens
and chat template from tokenizer_config.json (or chat_template.jinja, which newer transformers
write beside it and which wins, as in transformers).

Raw text is encoded the way HF's `tokenizer(text)` does (tokenizer.json's post-processor, e.g.
Llama 3's BOS); a chat the way `apply_chat_template(tokenize=True)` does (no post-processor: the
template writes its own BOS), except that special-token text inside messages stays plain text.
No tensor library: the router tokenizes with this.
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer

from pddjax.model.hf_config import CheckpointError, checkpoint_path, read_json
from pddjax.model.tokenizer import TextTokenizer

# tokenizer_config.json keys passed to the chat template as variables, as transformers does
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: str, config: dict) -> str | None:
    jinja = checkpoint_path(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default" | "tool_use" | ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class HFTokenizer(TextTokenizer):
    @classmethod
    def from_dir(cls, path: str) -> HFTokenizer | None:
        """The directory's tokenizer, or None when it has no tokenizer.json (prompts are then token ids)."""
        tok_path = checkpoint_path(path, "tokenizer.json")
        if not os.path.isfile(tok_path):
            return None
        try:
            tok = Tokenizer.from_file(tok_path)
        except Exception as e:  # the tokenizers library raises its own exception type
            raise CheckpointError(f"cannot read {tok_path} as a tokenizer: {e}") from None
        config = read_json(checkpoint_path(path, "tokenizer_config.json"), required=False) or {}
        texts = {k: _token_text(config.get(k)) for k in TEMPLATE_TOKENS}
        ids = {k: tok.token_to_id(t) if t is not None else None for k, t in texts.items()}
        return cls(tok, bos_id=ids["bos_token"], eos_id=ids["eos_token"], add_bos=False,
                   chat_template=_chat_template(path, config), post_process=True,
                   template_vars={k: t for k, t in texts.items() if t is not None})
