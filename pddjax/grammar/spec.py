"""What a constrained request asks for: a frozen, hashable `GrammarSpec` and its validation.

No llguidance here (the router validates requests with this module): `validate` checks the
form (kind, size, a schema that is a JSON object); what llguidance itself refuses (an
unsupported keyword, a bad regex or Lark rule) is refused when the spec is compiled
(`compiler.GrammarCompiler.compile`), with a ValueError naming the part as well.

A json_schema spec's text is the schema as canonical JSON (compact separators, keys in the
schema's own order: the order of "properties" is the order of the output's keys), so two
requests with the same schema share one compiled grammar (`key`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

KINDS = ("json_object", "json_schema", "regex", "lark")
MAX_TEXT_BYTES = 64 * 1024  # a spec's text (schema JSON, regex, Lark grammar), UTF-8


def _canonical(text):
    """A schema's canonical JSON, or `text` unchanged when it does not parse (`validate` refuses it)."""
    try:
        return json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return text


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    text: str = ""  # json_schema: the schema (canonical JSON); regex: the pattern; lark: the grammar; json_object: ""

    def __post_init__(self):
        if self.kind == "json_schema" and isinstance(self.text, str):
            object.__setattr__(self, "text", _canonical(self.text))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """Any JSON object."""
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema) -> GrammarSpec:
        """A JSON value valid against `schema` (a dict, or its JSON text)."""
        try:
            text = schema if isinstance(schema, str) else json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise ValueError(f"json_schema is not JSON: {e}") from None
        return cls("json_schema", text)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> GrammarSpec:
        return cls("lark", grammar)

    @property
    def key(self) -> str:
        """A stable hash of kind and text (the compiled-grammar cache's key)."""
        return hashlib.sha256(f"{self.kind}\0{self.text}".encode()).hexdigest()

    def validate(self) -> None:
        """Raises ValueError with one sentence naming the part that is wrong."""
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str):
            raise ValueError(f"the {self.kind} grammar's text must be a string, got {type(self.text).__name__}")
        size = len(self.text.encode("utf-8", "surrogatepass"))
        if size > MAX_TEXT_BYTES:
            raise ValueError(f"the {self.kind} grammar is too large: {size} bytes, at most {MAX_TEXT_BYTES}")
        if self.kind == "json_object":
            if self.text:
                raise ValueError("a json_object grammar takes no text (use json_schema for a schema)")
            return
        if not self.text.strip():
            raise ValueError(f"the {self.kind} grammar is empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")
