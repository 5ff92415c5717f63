"""Agent frameworks against the OpenAI-compatible gateway of a real `pddjax up` stack, unchanged:
the OpenAI Agents SDK (an agent with two function tools through three turns) and LangChain's
`ChatOpenAI` (`bind_tools`, `with_structured_output`), every request on the pdd pipeline (the
`pipeline` body extension, passed through each framework's own `extra_body`).

The model is the tiny random model as a chat GGUF (tests/support/chat_model.py): it says nothing
sensible, so every call and every structured answer that parses and validates was made so by the
grammar the gateway compiles from the tool's or the answer's schema (required / named tool choice,
json_schema). What each framework needed is stated beside its test.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import openai
import pydantic
import pytest

from tests.support.chat_model import write_model
from tests.support.serving_stack import launch_up
from tests.support.stack_checks import scrape

pytestmark = pytest.mark.timeout(400)

ENGINE = {"dtype": "float32", "page_size": 16, "num_pages": 256, "max_step_tokens": 128, "max_rows": 8}
KEY = "sk-pddjax-agents"
PDD = {"pipeline": "pdd", "seed": 7}
Small = Annotated[int, pydantic.Field(ge=0, le=999)]


def start_up(request, d):
    """The `up` fixture's stack (tests/serving/conftest.py): the chat GGUF, a bearer token."""
    model = str(d / "tinychat.gguf")
    write_model(model, request.getfixturevalue("tiny"), max_context=2048)  # room for a tools preamble
    (d / "token").write_text(KEY)
    stack = {"model": model, "platform": "cpu", "engine": ENGINE, "wan": {"mbps": 0, "latency_ms": 20}}
    return launch_up(d, stack, "--auth-token-file", str(d / "token"))


def pdd_completed(up) -> float:
    router = next(s for s in up.state["services"] if s["role"] == "router")
    return scrape(router["metrics"]).get(("pddjax_router_requests_completed_total", (("pipeline", "pdd"),)), 0.0)


def test_an_agents_sdk_agent_runs_two_tools_through_three_turns_on_pdd(up):
    """Needed: the chat-completions model class (`OpenAIChatCompletionsModel`: the gateway serves
    no Responses API), tracing off (it would post to api.openai.com), and `reset_tool_choice=False`
    with a `tool_use_behavior` that ends the run after the third turn's tool results (a random
    model under `auto` would answer in noise at once)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        ToolsToFinalOutputResult,
        function_tool,
    )

    calls: list[tuple[str, dict]] = []

    @function_tool
    def add(a: Small, b: Small) -> int:
        """Add two small integers."""
        calls.append(("add", {"a": a, "b": b}))
        return a + b

    @function_tool
    def weather(city: Literal["Oslo", "Paris"], unit: Literal["c", "f"]) -> str:
        """Today's weather in a city."""
        calls.append(("weather", {"city": city, "unit": unit}))
        return f"4 {unit.upper()} and rain in {city}"

    turns: list[int] = []

    def after_three_turns(context, results) -> ToolsToFinalOutputResult:
        turns.append(len(results))
        return ToolsToFinalOutputResult(is_final_output=len(turns) == 3,
                                        final_output=str(results[-1].output) if len(turns) == 3 else None)

    client = openai.AsyncOpenAI(base_url=up.state["openai"], api_key=KEY, max_retries=0, timeout=120)
    agent = Agent(name="assistant", instructions="Use the tools to answer.", tools=[add, weather],
                  model=OpenAIChatCompletionsModel(model="tinychat", openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=200, temperature=0.8,
                                               parallel_tool_calls=False, extra_body=PDD),
                  reset_tool_choice=False, tool_use_behavior=after_three_turns)
    before = pdd_completed(up)

    async def run():
        try:
            return await Runner.run(agent, "What is 2 + 3, and the weather in Oslo?", max_turns=5,
                                    run_config=RunConfig(tracing_disabled=True))
        finally:
            await client.close()

    result = asyncio.run(run())
    assert turns == [1, 1, 1], turns  # one call a turn (parallel_tool_calls false), three turns
    assert len(calls) == 3 and {name for name, _ in calls} <= {"add", "weather"}, calls
    name, args = calls[-1]
    last = f"4 {args['unit'].upper()} and rain in {args['city']}" if name == "weather" else str(args["a"] + args["b"])
    assert result.final_output == last, (result.final_output, calls)  # the third turn's tool result ended the run
    inputs = [r.usage.input_tokens for r in result.raw_responses]
    assert len(inputs) == 3 and inputs[0] < inputs[1] < inputs[2], inputs  # each turn's tool answer went back
    assert pdd_completed(up) - before == 3  # every turn on pdd


class Forecast(pydantic.BaseModel):
    city: Literal["Oslo", "Paris", "Rome"]
    high: Small
    rain: bool


def test_langchain_bind_tools_and_structured_output_on_pdd(up):
    """Needed: nothing beyond `base_url`, the key and `extra_body` for the pipeline; the tool
    choice by name and `method="json_schema"` (LangChain's default for ChatOpenAI) are enforced by
    grammars."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: Small, b: Small) -> int:
        """Add two small integers."""
        return a + b

    llm = ChatOpenAI(model="tinychat", base_url=up.state["openai"], api_key=KEY, max_retries=0, timeout=120,
                     max_tokens=200, temperature=0.8, extra_body=PDD)
    before = pdd_completed(up)
    with_tools = llm.bind_tools([add], tool_choice="add")
    question = HumanMessage("What is 2 + 3?")
    reply = with_tools.invoke([question])
    assert len(reply.tool_calls) == 1, (reply.content, reply.invalid_tool_calls, reply.response_metadata)
    (call,) = reply.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}, call
    answer = add.invoke(call["args"])
    assert answer == call["args"]["a"] + call["args"]["b"]
    second = with_tools.invoke([question, reply, ToolMessage(str(answer), tool_call_id=call["id"])])
    assert second.tool_calls and second.tool_calls[0]["name"] == "add"  # the tool turn went back and parsed
    assert second.usage_metadata["input_tokens"] > reply.usage_metadata["input_tokens"]

    forecast = llm.with_structured_output(Forecast).invoke("The forecast for Oslo tomorrow?")
    assert isinstance(forecast, Forecast), forecast  # parsed and validated by pydantic inside LangChain
    raw = llm.with_structured_output(Forecast, include_raw=True).invoke("And for Rome?")
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], Forecast), raw
    assert pdd_completed(up) - before == 4
