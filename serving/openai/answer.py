"""The router's GenerateResponses -> OpenAI responses and stream chunks.

`Answer` reads one Generate stream: the first message names the pipeline (and the prompt's
token ids), each later one carries tokens (ids, the tier that made them, their text delta),
the last one `finish_reason`, usage and timings. From it come the non-streamed
`chat.completion` / `text_completion`, and per router message one `chat.completion.chunk` /
streamed `text_completion`. Usage: prompt, completion and total tokens, `cached_tokens` =
prompt tokens P's prefix cache supplied (the computation the request skipped). The `pddjax`
extension (on the response, and on the stream's finishing chunk) holds the pipeline, the
relay/main token split, the handoff, the router's TTFT and total and the gateway's own TTFT
(its request received -> first token sent on); with `cache_hits` also both caches' hits, the
KV bytes that crossed, the policy's explanation and P's / the WAN's times.

Cache hits are the operator's to reveal (`cache_hits`, PDDJAX_OPENAI_CACHE_HITS=1; benchmarks
read them): a hit on a prefix tells a caller that someone sent it before, so by default
cached_tokens is 0 and the extension leaves out every figure that follows from a hit
(CACHE_FIELDS: the hits, the KV bytes and times that shrink with them, the explanation that
quotes them).
"""

from __future__ import annotations

import dataclasses
import json
import time

from serving.client import join_tool_calls
from serving.openai import schemas as s
from serving.pb import common_pb2, router_pb2

_TEXT_MARK, _ID_MARK = "pddjax-text-marker", 987654321987  # token_chunk_json's placeholders (nothing else holds them)
FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
          common_pb2.FINISH_REASON_CANCELLED: "stop", common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls"}
PIPELINES = {common_pb2.PIPELINE_AUTO: "auto", common_pb2.PIPELINE_PDD: "pdd",
             common_pb2.PIPELINE_PD_CROSS: "pd-cross", common_pb2.PIPELINE_PD_LOCAL: "pd-local"}
SOURCES = {common_pb2.ROLE_RELAY: "relay", common_pb2.ROLE_MAIN: "main", common_pb2.ROLE_PREFILL: "prefill"}
CACHE_FIELDS = ("explain", "cached_on_prefill", "cached_on_main", "kv_bytes_to_relay", "kv_bytes_to_main",
                "prefill_ms", "kv_to_main_ms")  # the extension's figures that tell a cache hit


@dataclasses.dataclass(frozen=True)
class Served:
    """The model as the gateway names it."""

    name: str
    fingerprint: str

    @property
    def system_fingerprint(self) -> str:
        return f"pddjax-{self.fingerprint}"


class Answer:
    def __init__(self, chat: bool, rid: str, served: Served, return_ids: bool, cache_hits: bool = False,
                 logprobs: bool = False):
        self.chat, self.rid, self.served, self.return_ids = chat, rid, served, return_ids
        self.logprobs = logprobs  # the request asked: every choice and token chunk carries them
        self.index = 0  # the choice's index (n > 1: serving/openai/choices.py)
        self.lps: list = []  # common_pb2.TokenLogprob per token (the router's, with token texts)
        self.lp_offset = 0  # a completion's text_offset of the next token
        self.calls: dict[int, dict] = {}  # tool calls by index: {"id", "name", "arguments"} (the router's parse)
        self.cache_hits = cache_hits  # tell the caches' hits (module docstring)
        self.created = int(time.time())
        self.pipeline, self.explain, self.prompt_ids = "", "", []
        self.token_ids: list[int] = []
        self.relay_tokens = self.main_tokens = 0
        self.text = ""
        self.finish: str | None = None
        self.usage_pb = router_pb2.Usage()
        self.timings_pb = router_pb2.Timings()
        self.gateway_ttft_ms: float | None = None  # the gateway's: request received -> first token sent on
        self._templates: dict[tuple[int, bool], tuple[str, ...]] = {}  # token_chunk_json's, per (source, usage_null)

    def take(self, msg: router_pb2.GenerateResponse) -> None:
        """One router message into the answer (the first names the pipeline)."""
        if msg.pipeline and not self.pipeline:
            self.pipeline, self.explain, self.prompt_ids = PIPELINES[msg.pipeline], msg.explain, list(
                msg.prompt_token_ids)
        self.token_ids += msg.token_ids
        self.lps += msg.logprobs
        join_tool_calls(self.calls, msg.tool_calls)
        for src in msg.sources:
            if src == common_pb2.ROLE_RELAY:
                self.relay_tokens += 1
            elif src == common_pb2.ROLE_MAIN:
                self.main_tokens += 1
        self.text += msg.text
        if msg.finish_reason:
            self.finish = FINISH.get(msg.finish_reason, "stop")
            self.usage_pb, self.timings_pb = msg.usage, msg.timings

    # ---- parts ---------------------------------------------------------------------------
    def usage(self) -> s.Usage:
        u = self.usage_pb
        completion = u.completion_tokens or len(self.token_ids)
        return s.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=completion,
                       total_tokens=u.prompt_tokens + completion,
                       prompt_tokens_details=s.PromptTokensDetails(
                           cached_tokens=u.cached_on_prefill if self.cache_hits else 0))

    def extension(self) -> dict:
        u, t = self.usage_pb, self.timings_pb
        ext = {"pipeline": self.pipeline, "explain": self.explain, "relay_tokens": u.relay_tokens,
                "main_tokens": u.main_tokens, "cached_on_prefill": u.cached_on_prefill,
                "cached_on_main": u.cached_on_main, "kv_bytes_to_relay": u.kv_bytes_to_relay,
                "kv_bytes_to_main": u.kv_bytes_to_main, "handoff_tokens": u.handoff_tokens,
                "handoff_chunks": u.handoff_chunks, "handoff_position": t.handoff_position,
                "router_ttft_ms": round(t.ttft_ms, 2), "router_total_ms": round(t.total_ms, 2),
                "prefill_ms": round(t.prefill_ms, 2), "kv_to_main_ms": round(t.kv_to_main_ms, 2),
                "gateway_ttft_ms": self.gateway_ttft_ms}
        if not self.cache_hits:
            for key in CACHE_FIELDS:
                del ext[key]
        return ext

    def _head(self) -> dict:
        head = dict(id=self.rid, created=self.created, model=self.served.name,
                    system_fingerprint=self.served.system_fingerprint)
        if self.return_ids:
            head["prompt_token_ids"] = self.prompt_ids
        return head

    def _logprobs(self, lps) -> s.ChatLogprobs | s.CompletionLogprobs | None:
        """OpenAI's logprobs of these tokens (None unless the request asked): chat's `content`
        list (token, logprob, its UTF-8 bytes, the alternatives), a completion's parallel lists
        (tokens, token_logprobs, top_logprobs as {token: logprob}, text_offset)."""
        if not self.logprobs:
            return None
        if self.chat:
            return s.ChatLogprobs(content=[s.TokenLogprob(
                token=lp.token, logprob=lp.logprob, bytes=list(lp.token_bytes or lp.token.encode()),
                top_logprobs=[s.TopLogprob(token=t, logprob=v, bytes=list(raw or t.encode()))
                              for t, v, raw in zip(lp.top_tokens, lp.top_logprobs,
                                                   lp.top_token_bytes or [b""] * len(lp.top_tokens))])
                for lp in lps])
        offsets = []
        for lp in lps:
            offsets.append(self.lp_offset)
            self.lp_offset += len(lp.token)
        return s.CompletionLogprobs(tokens=[lp.token for lp in lps], token_logprobs=[lp.logprob for lp in lps],
                                    top_logprobs=[dict(zip(lp.top_tokens, lp.top_logprobs)) for lp in lps],
                                    text_offset=offsets)

    def _ids(self, ids) -> dict:
        return {"token_ids": list(ids)} if self.return_ids else {}

    # ---- whole responses -----------------------------------------------------------------
    def response(self) -> s.ChatCompletion | s.Completion:
        common = dict(**self._head(), usage=self.usage(), pddjax=self.extension())
        if self.chat:
            calls = [s.ToolCall(id=c["id"], type="function",
                                function=s.Function(name=c["name"], arguments=c["arguments"]))
                     for _, c in sorted(self.calls.items())]
            message = (s.AssistantMessage(role="assistant", content=self.text or None, tool_calls=calls) if calls
                       else s.AssistantMessage(role="assistant", content=self.text))
            choice = s.ChatChoice(index=self.index, message=message,
                                  finish_reason=self.finish, logprobs=self._logprobs(self.lps),
                                  **self._ids(self.token_ids))
            return s.ChatCompletion(object="chat.completion", choices=[choice], **common)
        choice = s.CompletionChoice(index=self.index, text=self.text, finish_reason=self.finish,
                                    logprobs=self._logprobs(self.lps), **self._ids(self.token_ids))
        return s.Completion(object="text_completion", choices=[choice], **common)

    # ---- stream chunks -------------------------------------------------------------------
    def chunk(self, text: str | None, ids=(), finish: str | None = None, role: bool = False,
              usage_null: bool = False, source: int = 0, lps=None, calls=()) -> s.ChatCompletionChunk | s.Completion:
        """One chunk: `text` (chat: the delta's content; None: no content key), the ids it
        carries (and `lps`, their TokenLogprobs, when the request asked), `finish` on the last;
        `role` on a chat's first; `usage_null` when the client asked for usage (every chunk but
        the last then says usage: null)."""
        logprobs = self._logprobs(lps) if lps is not None else None
        extra: dict = {"usage": None} if usage_null else {}
        if finish is not None:
            extra["pddjax"] = self.extension()
        elif source:
            extra["pddjax"] = {"source": SOURCES.get(source, "?")}
        head = self._head() if role or finish is not None else {k: v for k, v in self._head().items()
                                                                  if k != "prompt_token_ids"}
        if self.chat:
            delta = s.Delta(role="assistant", content=text or "") if role else (
                s.Delta(content=text) if text is not None else s.Delta())
            if calls:  # the router's ToolCallDeltas: a call's head (index, id, name) with its arguments
                delta.tool_calls = [{"index": c.index, **({"id": c.id, "type": "function"} if c.id else {}),
                                     "function": {**({"name": c.name} if c.id else {}), "arguments": c.arguments}}
                                    for c in calls]
            choice = s.ChatChunkChoice(index=self.index, delta=delta, finish_reason=finish, logprobs=logprobs,
                                       **(self._ids(ids) if not role else {}))
            return s.ChatCompletionChunk(object="chat.completion.chunk", choices=[choice], **head, **extra)
        choice = s.CompletionChoice(index=self.index, text=text or "", finish_reason=finish, logprobs=logprobs,
                                    **(self._ids(ids) if not role else {}))
        return s.Completion(object="text_completion", choices=[choice], **head, **extra)

    def message_chunk_json(self, msg: router_pb2.GenerateResponse, usage_null: bool) -> str:
        """The chunk of one router message that carries tokens, text or tool calls: from the
        per-request template, unless it carries logprobs or calls (then built whole)."""
        src = msg.sources[0] if msg.sources else 0
        if not self.logprobs and not msg.tool_calls:
            return self.token_chunk_json(msg.text, msg.token_ids, usage_null, src)
        return self.chunk(msg.text if msg.text or not msg.tool_calls else None, msg.token_ids, usage_null=usage_null,
                          source=src, lps=msg.logprobs if self.logprobs else None,
                          calls=msg.tool_calls).model_dump_json(exclude_unset=True)

    def token_chunk_json(self, text: str, ids, usage_null: bool = False, source: int = 0) -> str:
        """`chunk(text, ids, usage_null=, source=)` as JSON (exclude_unset), without building a
        model per token: the chunk of this (source, usage_null) is validated and dumped once with
        marker values, and each token chunk puts its text (json.dumps) and ids in their place."""
        parts = self._templates.get((source, usage_null))
        if parts is None:
            parts = self._templates[(source, usage_null)] = self._template(usage_null, source)
        if len(parts) == 3:
            return f"{parts[0]}{json.dumps(text, ensure_ascii=False)}{parts[1]}{','.join(map(str, ids))}{parts[2]}"
        return f"{parts[0]}{json.dumps(text, ensure_ascii=False)}{parts[1]}"

    def _template(self, usage_null: bool, source: int) -> tuple[str, ...]:
        dumped = self.chunk(_TEXT_MARK, [_ID_MARK], usage_null=usage_null, source=source).model_dump_json(
            exclude_unset=True)
        text_at, ids_at = json.dumps(_TEXT_MARK), f"[{_ID_MARK}]"
        head, _, rest = dumped.partition(text_at)
        if not self.return_ids:
            return head, rest
        mid, _, tail = rest.partition(ids_at)
        return head, mid + "[", "]" + tail

    def usage_chunk(self) -> s.ChatCompletionChunk | s.Completion:
        """include_usage's last chunk: no choices, the usage."""
        head = {k: v for k, v in self._head().items() if k != "prompt_token_ids"}
        if self.chat:
            return s.ChatCompletionChunk(object="chat.completion.chunk", choices=[], usage=self.usage(), **head)
        return s.Completion(object="text_completion", choices=[], usage=self.usage(), **head)
