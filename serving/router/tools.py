"""A chat request's tools on the router: checked, rendered through the model's chat template,
forced by a grammar when the caller requires a call, and parsed back out of the output.

`ToolPlan.read(chat, tokenizer, override)` checks the Chat's `tools_json`, `tool_choice`,
`single_tool_call` and its messages (serving/tool_calls/validate.py; Abort INVALID_ARGUMENT
with the sentence), picks the parser for the model family (`choose`: the `[router] tool_parser`
override, else the chat template's markers) and, for "required" or a named function, the Lark
grammar that forces the call (`grammar`: every tier masks by it, P's first token included).
`messages(chat)` is the chat as the template reads it (assistant `tool_calls` with arguments
as JSON text, a "tool" message's `tool_call_id`). `ToolText` turns the output's text deltas into
content text and ToolCallDeltas, holding back text that may open a call.
"""

from __future__ import annotations

import dataclasses
import json

import grpc

from serving.pb import common_pb2, router_pb2
from serving.router.request import Abort
from serving.tool_calls import choose, grammar, parsers, validate


def messages(chat: router_pb2.Chat) -> list[dict]:
    out = []
    for m in chat.messages:
        d: dict = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _choice(chat: router_pb2.Chat):
    c = chat.tool_choice
    if c in ("", "auto", "none", "required"):
        return c or None
    return {"type": "function", "function": {"name": c}}


@dataclasses.dataclass
class ToolPlan:
    tools: list[dict]  # OpenAI's tools, checked
    choice: validate.ToolChoice
    family: str  # the parser ("hermes", "llama3", "mistral")

    @classmethod
    def read(cls, chat: router_pb2.Chat, tokenizer, override: str = "") -> ToolPlan | None:
        """The request's tools (None: it has none); Abort INVALID_ARGUMENT naming what is wrong."""
        try:
            validate.check_messages(messages(chat))
            if not chat.tools_json:
                if chat.tool_choice not in ("", "auto", "none"):
                    raise ValueError(f"tool_choice {chat.tool_choice!r} needs tools")
                return None
            try:
                tools = json.loads(chat.tools_json)
            except ValueError as e:
                raise ValueError(f"tools is not JSON: {e}") from None
            choice = validate.check_tools(tools, _choice(chat), not chat.single_tool_call)
            family = choose.choose(getattr(tokenizer, "chat_template", None), None, override or None)
        except ValueError as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return cls(tools, choice, family)

    @property
    def parses(self) -> bool:
        """The output is read for calls (none: tool_choice "none")."""
        return self.choice.mode != "none"

    def grammar(self, tokenizer) -> common_pb2.Grammar | None:
        """The grammar that forces the call ("required", a named function), or None."""
        try:
            g = grammar.call_grammar(self.family, self.tools, self.choice, getattr(tokenizer, "special_ids", None))
        except ValueError as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return None if g is None else common_pb2.Grammar(kind=g[0], text=g[1])

    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


class ToolText:
    """The output's text deltas -> (content text, [ToolCallDelta]); `called` once a call went out."""

    def __init__(self, plan: ToolPlan):
        self.stream = parsers.make(plan.family, plan.names())
        self.called = False

    def add(self, text: str, final: bool) -> tuple[str, list[router_pb2.ToolCallDelta]]:
        pieces = self.stream.feed(text) if text else []
        if final:
            pieces += self.stream.finish()
        content, calls = [], []
        for d in pieces:
            if "content" in d:
                content.append(d["content"])
            for c in d.get("tool_calls", ()):
                fn = c.get("function", {})
                calls.append(router_pb2.ToolCallDelta(index=c["index"], id=c.get("id", ""), name=fn.get("name", ""),
                                                      arguments=fn.get("arguments", "")))
        self.called = self.called or bool(calls)
        return "".join(content), calls
