"""The tiny random model as a chat model: its weights written as a GGUF with
tests/support/gguf_factory.py's byte-level tokenizer and a ChatML template, so text prompts,
chats, stop strings and grammars work at the tiny model's speed."""

from __future__ import annotations

import pytest

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_model(path: str, tiny, max_context: int | None = None) -> None:
    """The tiny model's weights as a GGUF with tests/support/gguf_factory.py's tokenizer plus a chat
    template; `max_context`: a longer context than the tiny model's 512 (a tools preamble is long)."""
    import gguf

    from tests.support import gguf_factory

    class WithTemplate(gguf.GGUFWriter):
        def write_header_to_file(self, *a, **kw):
            self.add_chat_template(CHATML)
            super().write_header_to_file(*a, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(gguf, "GGUFWriter", WithTemplate)
    try:
        cfg = tiny.config if max_context is None else tiny.config.replace(max_context=max_context)
        gguf_factory.write_llama_gguf(path, cfg, tiny.weights)
    finally:
        mp.undo()
