"""The tool-call parsers by family name: `make(name)` -> a fresh `CallStream` for one output.

- "hermes": `<tool_call>{"name", "arguments"}</tool_call>` (Qwen2 / Qwen2.5 / Qwen3, SmolLM2, Hermes; `hermes.py`)
- "llama3": Llama 3.1+ JSON `{"name", "parameters"}`, optionally after `<|python_tag|>` (`llama3.py`)
- "mistral": `[TOOL_CALLS][{"name", "arguments"}, ...]` (`mistral.py`)
Each family's docstring says how its malformed calls fall back to content. `choose.py` picks a
checkpoint's family.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from serving.tool_calls.hermes import HermesStream
from serving.tool_calls.llama3 import Llama3Stream
from serving.tool_calls.mistral import MistralStream
from serving.tool_calls.stream import CallStream, Parsed

PARSERS: dict[str, type[CallStream]] = {"hermes": HermesStream, "llama3": Llama3Stream, "mistral": MistralStream}


def make(family: str, names: Iterable[str] | None = None, new_id: Callable[[], str] | None = None) -> CallStream:
    """A fresh stream of `family`'s parser; names: the request's function names (None: any)."""
    cls = PARSERS.get(family)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {family!r}: use one of {', '.join(sorted(PARSERS))}")
    return cls(names) if new_id is None else cls(names, new_id)


def parse(family: str, text: str, names: Iterable[str] | None = None) -> Parsed:
    """A whole output's content and calls."""
    return make(family, names).parse(text)
