"""A GenerateRequest read and checked before anything is reserved (Generate's first stage).

The prompt comes as token ids, text (the model's tokenizer) or a chat (its chat template);
the sampling parameters, max_tokens, stop token ids and pipeline are checked against the
model (`rpc.validate_spec`: vocabulary, context length, sampling ranges). Anything wrong is
INVALID_ARGUMENT with one sentence. What passes fills the request's "what was asked" fields,
with the SequenceSpec every tier is sent (EOS joins the stop ids unless `ignore_eos`) and the
handoff mode (the client's, else `[router] handoff`) and the stream interval (`interval.chosen`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import TYPE_CHECKING

import grpc

from pddjax.grammar.spec import GrammarSpec
from serving import rpc
from serving.pb import cluster_pb2, common_pb2
from serving.router import interval, tools
from serving.router.request import PIPELINE_NAMES, Abort

if TYPE_CHECKING:
    from serving.pb import router_pb2
    from serving.router.request import Request


MAX_PROMPT_CHARS = 1 << 20  # text or chat content, before tokenizing (the context bounds tokens)
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, MAX_STOP_IDS = 16, 256, 64


def _bounded(req: router_pb2.GenerateRequest) -> None:
    """Sizes a caller controls, checked before any work (one sentence each)."""
    chars = len(req.text) + sum(len(m.content) + len(m.role) for m in req.chat.messages)
    if chars > MAX_PROMPT_CHARS:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"the prompt has {chars} characters; at most "
                                                      f"{MAX_PROMPT_CHARS} are accepted")
    if len(req.stop_strings) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_STRING_CHARS for x in req.stop_strings):
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_STOP_STRINGS} stop strings of at most "
                                                      f"{MAX_STOP_STRING_CHARS} characters each are accepted")
    if len(req.stop_token_ids) > MAX_STOP_IDS:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_STOP_IDS} stop token ids are accepted, "
                                                      f"got {len(req.stop_token_ids)}")


def prompt_of(req: router_pb2.GenerateRequest, cfg, tokenizer, plan: tools.ToolPlan | None = None) -> list[int]:
    _bounded(req)
    kind = req.WhichOneof("prompt")
    if kind == "token_ids":
        return list(req.token_ids.ids)
    if kind is None:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "the request has no prompt")
    if tokenizer is None:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"model {cfg.name} has no tokenizer: send token_ids")
    if kind == "text":
        return tokenizer.encode(req.text) if req.text else []
    msgs = tools.messages(req.chat)
    if not msgs:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "the chat has no messages")
    try:
        return tokenizer.encode_chat(msgs, tools=plan.tools if plan else None)  # special-token text stays plain
    except Exception as e:  # noqa: BLE001  (template errors are the user's)
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot render the chat: {e}") from None


MAX_ID_CHARS = 256  # request_id and session_id: labels, bounded


# Text or chat longer than this is tokenized (and its template rendered) on a worker thread, so
# a large prompt does not stall every other stream on the router's event loop.
OFF_LOOP_CHARS = 4096


async def read(r: Request, req: router_pb2.GenerateRequest, cfg, tokenizer, handoff: str,
               tool_parser: str = "", stream_interval: tuple[int, float] = (1, 0.0)) -> None:
    """Fills `r` from `req` (its own random id; the client's request_id is its label), or raises Abort
    (INVALID_ARGUMENT). `handoff`: `[router] handoff`, for a request that names no mode;
    `tool_parser`: `[router] tool_parser` ("": the one the chat template's markers name);
    `stream_interval`: `[router] stream_interval` and `stream_interval_ms` (a request's only coarser)."""
    r.stream_interval = interval.chosen(*stream_interval, req)
    chat = req.WhichOneof("prompt") == "chat"
    if chat and len(req.chat.tools_json) > tools.validate.MAX_TOOLS_BYTES:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"tools hold {len(req.chat.tools_json)} bytes of JSON; at "
                                                      f"most {tools.validate.MAX_TOOLS_BYTES} are accepted")
    plan = tools.ToolPlan.read(req.chat, tokenizer, tool_parser) if chat and tokenizer is not None else None
    chars = len(req.text) + sum(len(m.content) for m in req.chat.messages) + len(req.chat.tools_json)
    if chars > OFF_LOOP_CHARS:
        prompt = await asyncio.to_thread(prompt_of, req, cfg, tokenizer, plan)
    else:
        prompt = prompt_of(req, cfg, tokenizer, plan)
    params = rpc.sampling_from_pb(req.sampling)
    forced = plan.grammar(tokenizer) if plan is not None and plan.parses else None
    if forced is not None:  # "required" or a named function: a grammar forces the call
        if params.grammar is not None:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "a request that requires a tool call cannot also carry "
                                                          "a grammar (response_format, regex or grammar)")
        params = dataclasses.replace(params, grammar=GrammarSpec(forced.kind, forced.text))
    r.tools = plan if plan is not None and plan.parses else None
    max_tokens = int(req.max_tokens)
    for name, value in (("request_id", req.request_id), ("session_id", req.session_id)):
        if len(value) > MAX_ID_CHARS or not value.isprintable():
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must be at most {MAX_ID_CHARS} printable "
                                                          f"characters, got {len(value)}")
    rid = uuid.uuid4().hex  # the tiers see only this: a client's id may repeat, or be reused at once
    err = rpc.validate_spec(cfg, rid, prompt, params, max_tokens)
    if err:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, err)
    if req.pipeline not in PIPELINE_NAMES:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown pipeline {req.pipeline}")
    bad = [t for t in req.stop_token_ids if t >= cfg.vocab_size]
    if bad:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"stop token id {bad[0]} is outside the vocabulary")
    stop_ids = tuple(() if req.ignore_eos else cfg.eos_token_ids) + tuple(req.stop_token_ids)
    r.rid, r.label, r.session = rid, req.request_id or rid, req.session_id
    r.prompt, r.max_tokens, r.requested = prompt, max_tokens, req.pipeline
    r.spec = cluster_pb2.SequenceSpec(request_id=rid, prompt=prompt, sampling=rpc.sampling_to_pb(params),
                                      max_tokens=max_tokens, stop_token_ids=stop_ids,
                                      no_speculation=req.HasField("speculative") and not req.speculative)
    r.mode = req.handoff or (common_pb2.HANDOFF_MODE_ONE_SHOT if handoff == "one-shot"
                             else common_pb2.HANDOFF_MODE_CHUNKED)
