"""A small synchronous client of the router's Generate (for `pddjax generate --router`, the
demo and tests): collects the stream into one result with per-token sources."""

from __future__ import annotations

import dataclasses
import json
import time

import grpc

from pddjax.addresses import host_of, is_loopback
from pddjax.grammar.spec import GrammarSpec
from pddjax.model.sampling_params import SamplingParams
from serving import rpc
from serving.pb import common_pb2, router_pb2, router_pb2_grpc

PIPELINES = {"auto": common_pb2.PIPELINE_AUTO, "pdd": common_pb2.PIPELINE_PDD,
             "pd-cross": common_pb2.PIPELINE_PD_CROSS, "pd-local": common_pb2.PIPELINE_PD_LOCAL}
HANDOFFS = {None: common_pb2.HANDOFF_MODE_UNSPECIFIED, "one-shot": common_pb2.HANDOFF_MODE_ONE_SHOT,
            "chunked": common_pb2.HANDOFF_MODE_CHUNKED}
_PIPELINE_NAMES = {v: k for k, v in PIPELINES.items()}
_SOURCES = {common_pb2.ROLE_RELAY: "relay", common_pb2.ROLE_MAIN: "main", common_pb2.ROLE_PREFILL: "prefill"}
_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
           common_pb2.FINISH_REASON_CANCELLED: "cancelled", common_pb2.FINISH_REASON_UNSPECIFIED: None}


class RouterError(Exception):
    """The router refused or failed the request: `code` (grpc.StatusCode) and one sentence."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Result:
    request_id: str
    pipeline: str
    prompt_ids: list[int]
    token_ids: list[int]
    sources: list[str]
    text: str
    finish_reason: str | None
    ttft_ms: float  # measured by this client: request sent -> first token received
    total_ms: float
    usage: dict
    timings: dict  # as the router measured them
    explain: str
    messages: int  # stream messages that carried tokens
    # when the request asked: per token (logprob, ((token id, logprob), ...) most likely first)
    logprobs: list = dataclasses.field(default_factory=list)
    tool_calls: list = dataclasses.field(default_factory=list)  # with tools: [{"id", "name", "arguments"}, ...]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def make_request(prompt_ids=None, text=None, chat=None, *, max_tokens=16, temperature=0.0, top_k=0, top_p=1.0,
                 seed=0, stop_ids=(), stop_strings=(), pipeline="auto", handoff=None, request_id="", session_id="",
                 ignore_eos=False, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                 logit_bias=(), logprobs=False, top_logprobs=0, grammar=None, tools=None, tool_choice="",
                 parallel_tool_calls=True) -> router_pb2.GenerateRequest:
    """A GenerateRequest; `logit_bias`: (token id, bias) pairs or a mapping of them; `grammar`:
    (kind, text), e.g. ("json_schema", '{"type": "object"}') or ("regex", "[a-z]+")."""
    sampling = rpc.sampling_to_pb(SamplingParams(
        temperature, top_k, top_p, seed, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, logit_bias=logit_bias, logprobs=logprobs, top_logprobs=top_logprobs,
        grammar=None if grammar is None else GrammarSpec(*grammar)))  # not validated: the router checks
    req = router_pb2.GenerateRequest(
        request_id=request_id, session_id=session_id, max_tokens=max_tokens, sampling=sampling,
        stop_token_ids=list(stop_ids), stop_strings=list(stop_strings), pipeline=PIPELINES[pipeline],
        handoff=HANDOFFS[handoff], ignore_eos=ignore_eos)
    if prompt_ids is not None:
        req.token_ids.ids.extend(prompt_ids)
    elif chat is not None:
        for m in chat:  # {"role", "content"}, an assistant's "tool_calls" ({"id", "name", "arguments"}), "tool_call_id"
            req.chat.messages.append(router_pb2.ChatMessage(
                role=m["role"], content=m.get("content") or "", tool_call_id=m.get("tool_call_id", ""),
                tool_calls=[router_pb2.ToolCall(**c) for c in m.get("tool_calls", ())]))
        if tools:
            req.chat.tools_json = json.dumps(tools)
        req.chat.tool_choice, req.chat.single_tool_call = tool_choice, not parallel_tool_calls
    else:
        req.text = text
    return req


def join_tool_calls(calls: dict[int, dict], deltas) -> None:
    """ToolCallDeltas into `calls` (index -> {"id", "name", "arguments"}): a call's id and name
    from its first delta, its arguments' pieces joined."""
    for c in deltas:
        call = calls.setdefault(c.index, {"id": "", "name": "", "arguments": ""})
        call["id"], call["name"] = c.id or call["id"], c.name or call["name"]
        call["arguments"] += c.arguments


class Client:
    """A client of the router's public port. It holds the CA that verifies the router (`ca`:
    PEM bytes or a path; else PDDJAX_TLS_CA, else PDDJAX_TLS_DIR's ca.pem; none: plaintext)
    and the bearer token (`token`, else PDDJAX_ROUTER_TOKEN_FILE's), never an internal
    certificate or key. A token is never sent in plaintext to a non-loopback address
    (security.SecurityConfigError, one sentence)."""

    def __init__(self, address: str, token: str | None = None, ca: bytes | str | None = None):
        from serving import security

        creds = security.client_credentials(ca)
        self.metadata = security.auth_metadata(token)
        if self.metadata and creds is None and not is_loopback(host_of(address)):
            raise security.SecurityConfigError(
                f"refusing to send the bearer token in plaintext to {address}: give the router's CA "
                f"(ca=, {security.CA_FILE_ENV} or {security.TLS_DIR_ENV})")
        self.channel = rpc.sync_channel(address, creds)
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def stream(self, req, timeout: float | None = None):
        return self.stub.Generate(req, timeout=timeout, metadata=self.metadata)

    def stream_tokens(self, req, timeout: float | None = None, cancel_after: int | None = None) -> list[int]:
        """The token ids of one Generate stream; with `cancel_after`, the client cancels the
        call once it has received more than that many messages and returns what it got.
        A gRPC error other than its own cancel is raised (grpc.RpcError)."""
        call, toks, n = self.stream(req, timeout=timeout), [], 0
        try:
            for msg in call:
                toks += msg.token_ids
                n += 1
                if cancel_after is not None and n > cancel_after:
                    call.cancel()
                    break
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED or cancel_after is None:
                raise
        return toks

    def generate(self, req: router_pb2.GenerateRequest, timeout: float | None = None, on_tokens=None) -> Result:
        t0 = time.perf_counter()
        ttft, toks, srcs, text, last, first, n, lps, calls = None, [], [], "", None, None, 0, [], {}
        try:
            for msg in self.stub.Generate(req, timeout=timeout, metadata=self.metadata):
                first = first or msg
                if msg.token_ids:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    n += 1
                    if on_tokens:
                        on_tokens(msg)
                toks += msg.token_ids
                srcs += [_SOURCES.get(s, "?") for s in msg.sources]
                text += msg.text
                lps += [(lp.logprob, tuple(zip(lp.top_ids, lp.top_logprobs))) for lp in msg.logprobs]
                join_tool_calls(calls, msg.tool_calls)
                last = msg
        except grpc.RpcError as e:
            raise RouterError(e.code(), e.details()) from None
        u, t = last.usage, last.timings
        usage = {f.name: getattr(u, f.name) for f in u.DESCRIPTOR.fields}
        timings = {f.name: round(getattr(t, f.name), 2) for f in t.DESCRIPTOR.fields}
        return Result(first.request_id, _PIPELINE_NAMES[first.pipeline], list(first.prompt_token_ids), toks, srcs, text,
                      _FINISH[last.finish_reason], round(1e3 * (ttft or 0), 2),
                      round(1e3 * (time.perf_counter() - t0), 2), usage, timings, first.explain, n, lps,
                      [calls[i] for i in sorted(calls)])
