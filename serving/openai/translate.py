"""OpenAI request bodies -> the router's GenerateRequest (checks first, one sentence each).

- prompt: a chat's `messages` (system / developer / user / assistant; string content or text
  parts, joined by newlines) go as the router's `chat` (its model's chat template); a
  completion's `prompt` as `text` (a string) or `token_ids` (a list of ints); one prompt only;
- sampling: temperature (OpenAI's default 1.0), top_p, the `top_k` extension, and a seed
  (0 <= seed < 2^31, the engines' range; none given and temperature > 0: a random one, as
  OpenAI samples anew);
- length: `max_completion_tokens` or `max_tokens`, else the gateway's default;
- stops: `stop` (a string or a list) as stop strings, `stop_token_ids`; `ignore_eos`;
- penalties: `presence_penalty`, `frequency_penalty` (OpenAI's, over generated tokens, in
  [-2, 2]), the `repetition_penalty` extension (Hugging Face's, over prompt and output, in
  (0, 2]), `logit_bias` (at most 300 token ids, given as strings, each bias in [-100, 100]);
- logprobs: chat's `logprobs` + `top_logprobs` (0..20), a completion's `logprobs` (0..5: the
  sampled token's and that many alternatives); each is the log-softmax of the model's raw
  logits, before penalties, bias and temperature (as vLLM reports them by default);
- structured output: `response_format` json_object / json_schema (its `schema`), or the
  extensions `regex` and `grammar` (a Lark grammar), one at a time: the tiers mask every token
  the language does not allow (pddjax/grammar), the first token included;
- placement: `pipeline`, `handoff`, `session_id` (else the `x-session-id` header);
- streaming: the `stream_interval` (tokens per chunk) and `stream_interval_ms` (a token's longest
  wait, 0: none) extensions, the router's fields (coarser than its own only);
- tools: `tools` (functions), `tool_choice` (none / auto / required / a named function: the
  last two forced by a grammar), `parallel_tool_calls`, assistant `tool_calls` and "tool"
  messages, checked here and passed to the router, which renders them through the model's chat
  template and parses the calls out of the output (serving/router/tools.py);
- n (1..MAX_N): n choices, each its own router request (serving/openai/choices.py);
- echo, suffix and best_of are refused by name (400): pddjax does not
  serve them, and silently ignoring them would mislead. A value out of range is a 400 naming
  its field, before anything is sent to the router.
The response id (`chatcmpl-...` / `cmpl-...`) is the router's request_id label, so both logs
name the request alike.
"""

from __future__ import annotations

import json
import secrets

from pddjax.grammar.spec import GrammarSpec
from pddjax.model.sampling_params import SamplingParams
from serving import rpc
from serving.client import HANDOFFS, PIPELINES
from serving.openai.errors import invalid
from serving.openai.schemas import UINT32, ChatCompletionRequest, CompletionRequest
from serving.pb import common_pb2, router_pb2
from serving.tool_calls import validate

MAX_N = 16  # choices per request (serving/openai/choices.py)
SEEDS = 1 << 31  # pddjax.model.sampling_params: seeds in [0, 2^31)
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    if body.n is not None and not 1 <= body.n <= MAX_N:
        raise invalid(f"n must be in [1, {MAX_N}], got {body.n}", "n")
    if not isinstance(body, ChatCompletionRequest):
        if body.echo:
            raise invalid("echo is not supported", "echo")
        if body.suffix:
            raise invalid("suffix is not supported", "suffix")
        if body.best_of not in (None, 1):
            raise invalid(f"best_of must be 1, got {body.best_of}", "best_of")


def chat_messages(body: ChatCompletionRequest) -> list[router_pb2.ChatMessage]:
    out = []
    for i, m in enumerate(body.messages):
        role = CHAT_ROLES.get(m.role)
        if role is None:
            raise invalid(f"messages[{i}].role {m.role!r} is not supported (use system, user, assistant or tool)",
                          f"messages.{i}.role")
        calls = [router_pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                 for c in m.tool_calls or ()]  # checked by tools()
        if m.content is None and not calls:
            raise invalid(f"messages[{i}] has no content", f"messages.{i}.content")
        if m.content is None:
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
            bad = [p.type for p in m.content if p.type != "text" or p.text is None]
            if bad:
                raise invalid(f"messages[{i}] has a {bad[0]!r} content part: only text parts are supported",
                              f"messages.{i}.content")
            text = "\n".join(p.text for p in m.content)
        out.append(router_pb2.ChatMessage(role=role, content=text, tool_calls=calls, tool_call_id=m.tool_call_id or ""))
    return out


def tools(body: ChatCompletionRequest, chat: router_pb2.Chat) -> None:
    """`tools`, `tool_choice`, `parallel_tool_calls` and the tool messages, checked (400 naming
    the part) into the router's Chat."""
    try:
        validate.check_messages([m.model_dump(exclude_none=True) for m in body.messages])
        choice = validate.check_tools(body.tools or [], body.tool_choice, body.parallel_tool_calls)
    except ValueError as e:
        field = str(e).partition(".")[0].partition("[")[0].split()[0]
        raise invalid(str(e), field if field in ("tools", "tool_choice", "messages", "parallel_tool_calls")
                      else None) from None
    if body.tools:
        chat.tools_json = json.dumps(body.tools)
    chat.tool_choice = choice.name if choice.mode == "function" else ("" if choice.mode == "auto" else choice.mode)
    chat.single_tool_call = not choice.parallel


def _prompt(body: CompletionRequest, req: router_pb2.GenerateRequest) -> None:
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], str | list):  # a batch: only a batch of one
        if len(p) != 1:
            raise invalid(f"send one prompt per request (got a batch of {len(p)})", "prompt")
        p = p[0]
    if isinstance(p, str):
        req.text = p
        return
    if not p:
        raise invalid("the prompt is empty", "prompt")
    if any(not 0 <= t <= UINT32 for t in p):
        raise invalid("prompt token ids must be non-negative 32-bit integers", "prompt")
    req.token_ids.ids.extend(p)


MAX_COMPLETION_LOGPROBS = 5  # a completion's `logprobs` (OpenAI's bound)
SAMPLING_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "top_logprobs",
                   "logprobs", "temperature", "top_k", "top_p", "seed")


def _logprobs(body: ChatCompletionRequest | CompletionRequest) -> tuple[bool, int]:
    """(logprobs on, alternatives per token) as the endpoint spells them."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        return bool(body.logprobs), body.top_logprobs or 0
    n = body.logprobs
    if n is None:
        return False, 0
    if not 0 <= n <= MAX_COMPLETION_LOGPROBS:
        raise invalid(f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}], got {n}", "logprobs")
    return True, n


def _bias(body) -> dict[int, float]:
    out = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            out[int(key)] = value
        except ValueError:
            raise invalid(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
    return out


def grammar(body: ChatCompletionRequest | CompletionRequest) -> GrammarSpec | None:
    """The output's language: `response_format` json_object / json_schema, or the `regex` /
    `grammar` (Lark) extension; at most one of them. Its form is checked here (400 naming the
    field); what the grammar engine refuses, the first tier says (the router's 400)."""
    asked = []
    fmt = body.response_format
    if fmt is not None:
        kind = fmt.get("type", "text") if isinstance(fmt, dict) else None
        if kind == "json_object":
            asked.append(("response_format", GrammarSpec.json_object()))
        elif kind == "json_schema":
            js = fmt.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise invalid("response_format.json_schema must be an object with a `schema` object",
                              "response_format")
            asked.append(("response_format", GrammarSpec.json_schema(js.get("schema", {}))))
        elif kind != "text":
            raise invalid(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                          "response_format")
    if body.regex is not None:
        asked.append(("regex", GrammarSpec.regex(body.regex)))
    if body.grammar is not None:
        asked.append(("grammar", GrammarSpec.lark(body.grammar)))
    if not asked:
        return None
    if len(asked) > 1:
        raise invalid(f"send one of response_format, regex and grammar, not {' and '.join(n for n, _ in asked)}",
                      asked[1][0])
    field, spec = asked[0]
    try:
        spec.validate()
    except ValueError as e:
        raise invalid(str(e), field) from None
    return spec


def sampling(body: ChatCompletionRequest | CompletionRequest, temperature: float, seed: int) -> common_pb2.Sampling:
    """The request's sampling, checked with the engines' own bounds (400 naming the field)."""
    logprobs, top = _logprobs(body)
    params = SamplingParams(temperature, body.top_k or 0, 1.0 if body.top_p is None else body.top_p, seed,
                            presence_penalty=body.presence_penalty or 0.0,
                            frequency_penalty=body.frequency_penalty or 0.0,
                            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                            logit_bias=_bias(body), logprobs=logprobs, top_logprobs=top, grammar=grammar(body))
    try:
        params.validate()
    except ValueError as e:
        field = next((f for f in SAMPLING_FIELDS if str(e).startswith(f)), None)
        raise invalid(str(e), field) from None
    return rpc.sampling_to_pb(params)


def generate_request(body: ChatCompletionRequest | CompletionRequest, request_id: str, session_header: str | None,
                     default_max_tokens: int) -> router_pb2.GenerateRequest:
    refuse_unsupported(body)
    temperature = 1.0 if body.temperature is None else body.temperature
    seed = body.seed
    if seed is None:
        seed = secrets.randbelow(SEEDS) if temperature > 0 else 0
    elif not 0 <= seed < SEEDS:
        raise invalid(f"seed must be in [0, 2^31), got {seed}", "seed")
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    req = router_pb2.GenerateRequest(
        request_id=request_id, session_id=body.session_id or session_header or "",
        sampling=sampling(body, temperature, seed),
        max_tokens=max_tokens or default_max_tokens, stop_strings=[s for s in stops if s],
        stop_token_ids=body.stop_token_ids or [], pipeline=PIPELINES[body.pipeline or "auto"],
        handoff=HANDOFFS[body.handoff], ignore_eos=body.ignore_eos)
    if body.stream_interval is not None:  # unset: the router's; coarser only (it raises a finer one)
        req.stream_interval = body.stream_interval
    if body.stream_interval_ms is not None:
        req.stream_interval_ms = body.stream_interval_ms
    if isinstance(body, ChatCompletionRequest):
        req.chat.messages.extend(chat_messages(body))
        tools(body, req.chat)
    else:
        _prompt(body, req)
    return req
