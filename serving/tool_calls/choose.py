"""Which tool-call parser a checkpoint gets: by name from config, else from its chat template and architecture.

In order (the first that applies):
1. `override` (config) names a parser: that one (an unknown name is a ValueError);
2. the template's text holds a family's call marker: `[TOOL_CALLS]` -> "mistral", `<|python_tag|>` ->
   "llama3", `<tool_call>` -> "hermes";
3. the template does not read `tools` (or there is none): "hermes", since `pddjax.model.chat_template`
   then writes the tools as a Hermes preamble that asks for `<tool_call>` (SmolLM2 is this case: a
   plain ChatML template on a llama architecture);
4. the architecture (config.json's `architectures` / `model_type`, or a GGUF's `general.architecture`):
   llama -> "llama3", mistral / mixtral -> "mistral", qwen -> "hermes";
5. else "hermes".
"""

from __future__ import annotations

from pddjax.model.chat_template import features
from serving.tool_calls.parsers import PARSERS

MARKERS = (("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3"), ("<tool_call>", "hermes"))
ARCHITECTURES = (("mistral", "mistral"), ("mixtral", "mistral"), ("qwen", "hermes"), ("llama", "llama3"))


def choose(chat_template: str | None, architecture: str | None = None, override: str | None = None) -> str:
    """The parser's name for a checkpoint with this chat template and architecture (module docstring)."""
    if override:
        if override not in PARSERS:
            raise ValueError(f"tool_parser {override!r} is not one of {', '.join(sorted(PARSERS))}")
        return override
    for marker, family in MARKERS:
        if chat_template and marker in chat_template:
            return family
    if not chat_template or not features(chat_template).tools:
        return "hermes"
    arch = (architecture or "").lower()
    return next((family for key, family in ARCHITECTURES if key in arch), "hermes")
