"""The OpenAI request and response bodies the gateway speaks (pydantic models).

Requests: `ChatCompletionRequest` (POST /v1/chat/completions) and `CompletionRequest` (POST
/v1/completions), the OpenAI fields plus pddjax's extensions (`top_k`, `pipeline`, `handoff`,
`session_id`, `ignore_eos`, `stop_token_ids`, `return_token_ids`, `request_timeout`, `stream_interval`,
`stream_interval_ms`: the router's stream interval, serving/router/interval.py). Fields
the OpenAI API has and pddjax does not serve (tools, n > 1, echo ...) are
declared so `translate` can refuse them by name; other unknown fields are ignored. Sizes a
caller controls are bounded before any per-item work (a list's length is checked before its
items are): at most MAX_MESSAGES messages (and text parts per message), MAX_PROMPT_IDS prompt
ids, MAX_STOP_IDS stop ids; numbers are finite (JSON's Infinity / NaN are refused).

Responses are built with every field they carry set explicitly and dumped with
`exclude_unset=True`: OpenAI's nulls stay (`finish_reason: null`, `usage: null` in a stream
with include_usage), extension fields a request did not ask for stay out.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

UINT32 = (1 << 32) - 1
MAX_MESSAGES = 2048  # a chat's messages, and a message's content parts
MAX_PROMPT_IDS = 1 << 18  # a completion's prompt ids (past any served context; the router checks the model's)
MAX_STOP_IDS = 64  # as the router's
MAX_STREAM_INTERVAL, MAX_STREAM_INTERVAL_MS = 1024, 60_000  # as the router's (serving/config.py)


def _at_most(value, limit: int, what: str, count: int | None = None):
    """`value` unchanged unless it is a list longer than `limit` (or `count` is: checked before any item is)."""
    n = count if count is not None else len(value) if isinstance(value, list) else 0
    if n > limit:
        raise ValueError(f"at most {limit} {what} are accepted, got {n}")
    return value


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextPart(_Body):
    type: str
    text: str | None = None


class Message(_Body):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[Any] | None = Field(None, max_length=128)  # an assistant's
    tool_call_id: str | None = None  # a "tool" message's: the call it answers
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts_bounded(cls, v):
        return _at_most(v, MAX_MESSAGES, "content parts")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """What both endpoints take."""

    model: str
    max_tokens: int | None = Field(None, ge=1, le=UINT32)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None  # [-2, 2]
    frequency_penalty: float | None = None  # [-2, 2]
    logit_bias: dict[str, float] | None = Field(None, max_length=300)  # token id (a string) -> [-100, 100]
    # pddjax extensions
    repetition_penalty: float | None = None  # (0, 2], Hugging Face's; 1: off
    regex: str | None = None  # the output matches this regular expression (constrained decoding)
    grammar: str | None = None  # ... or this Lark grammar (llguidance's dialect)
    top_k: int | None = Field(None, ge=0, le=UINT32)
    pipeline: Literal["auto", "pdd", "pd-cross", "pd-local"] | None = None
    handoff: Literal["one-shot", "chunked"] | None = None
    session_id: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=UINT32)]] | None = Field(None, max_length=MAX_STOP_IDS)
    return_token_ids: bool = False  # per choice (and chunk) `token_ids`, top-level `prompt_token_ids`
    request_timeout: float | None = Field(None, gt=0)  # seconds: the router's deadline (504 past it)
    stream_interval: int | None = Field(None, ge=1, le=MAX_STREAM_INTERVAL)  # tokens per chunk (coarser only)
    stream_interval_ms: int | None = Field(None, ge=0, le=MAX_STREAM_INTERVAL_MS)  # a token's longest wait (0: none)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = Field(None, max_length=128)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_bounded(cls, v):
        return _at_most(v, MAX_MESSAGES, "messages")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    response_format: dict[str, Any] | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_bounded(cls, v):
        v = _at_most(v, MAX_PROMPT_IDS, "prompt token ids")
        if isinstance(v, list) and v and isinstance(v[0], list):  # a batch: its ids together
            _at_most(v, MAX_PROMPT_IDS, "prompt token ids", sum(len(p) for p in v if isinstance(p, list)))
        return v


# ---- responses ---------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Function(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: Function


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {"index", "id", "type", "function": {"name", "arguments"}}


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None


class _Response(BaseModel):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[Any]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    pddjax: dict[str, Any] | None = None  # the extension: pipeline, relay/main split, caches, timings


class ChatCompletion(_Response):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]


class Completion(_Response):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    pddjax: dict[str, Any]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody
