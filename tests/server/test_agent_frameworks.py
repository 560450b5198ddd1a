"""Real agent frameworks against `segue serve` on the default model (SmolLM2-135M-Instruct).

Each framework runs a tool-using agent end to end, streaming and not: the model calls the tool
(constrained decoding makes the call and its arguments valid), the framework runs it and feeds
the result back, and the model writes the final answer. The agents force the first call
(tool_choice "required") and forbid further ones once the result is in: a 135M model given "auto"
after a tool result keeps calling the same tool again (measured: 8 of 8 tries, BENCHMARKS.md), so
these agents encode the decision the model cannot make. The framework paths exercised are the real
ones: tool-call parsing, argument decoding, tool messages, the final answer.

No sampling settings are sent: the server applies the model's recommended ones.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Any, Iterator, Literal, Optional

import httpx
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "segue.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--kv-cache-tokens", "8192"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"segue serve exited: {proc.stderr.read().decode()[-2000:]}"  # type: ignore[union-attr]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "segue serve did not come up"
            time.sleep(0.5)
        yield url + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def model_name(url: str) -> str:
    return httpx.get(url + "/models").json()["data"][0]["id"]


# ---- OpenAI Agents SDK ---------------------------------------------------------------------

def run_openai_agent(url: str, stream: bool) -> tuple[Any, list[dict[str, Any]], list[str]]:
    from agents import (
        Agent,
        AgentHooks,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[dict[str, Any]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append({"city": city})
        return f"It is sunny and 21 C in {city}."

    class AnswerAfterResult(AgentHooks):
        async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: object) -> None:
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    async def main() -> tuple[Any, list[str]]:
        client = AsyncOpenAI(base_url=url, api_key="unused")
        agent = Agent(name="weather", instructions="You answer questions about the weather.",
                      tools=[get_weather], hooks=AnswerAfterResult(), reset_tool_choice=False,
                      model=OpenAIChatCompletionsModel(model=model_name(url), openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS))
        events: list[str] = []
        if stream:
            result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
            async for ev in result.stream_events():
                events.append(ev.type)
        else:
            result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        await client.close()
        return result, events

    result, events = asyncio.run(main())
    return result, calls, events


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
def test_openai_agents_sdk_tool_agent(server_url: str, stream: bool) -> None:
    from agents.items import ToolCallItem, ToolCallOutputItem

    result, calls, events = run_openai_agent(server_url, stream)
    assert len(calls) == 1 and isinstance(calls[0]["city"], str) and calls[0]["city"].strip()
    kinds = [type(item) for item in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds
    outputs = [item.output for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert outputs == [f"It is sunny and 21 C in {calls[0]['city']}."]
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert "<tool_call>" not in result.final_output
    if stream:
        assert "raw_response_event" in events and "run_item_stream_event" in events


# ---- LangGraph + langchain-openai ----------------------------------------------------------

def tool_graph(caller: Any, answerer: Any, tool_fn: Any) -> Any:
    """The one-tool agent graph both LangGraph tests run: `caller` until a tool result is in,
    then `answerer` answers from it."""
    from langchain_core.messages import ToolMessage
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    def agent(state: MessagesState) -> dict[str, Any]:
        answered = isinstance(state["messages"][-1], ToolMessage)
        return {"messages": [(answerer if answered else caller).invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([tool_fn]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: END})
    graph.add_edge("tools", "agent")
    return graph.compile()


def run_langgraph_agent(url: str, stream: bool) -> tuple[list[Any], list[dict[str, Any]], int]:
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    calls: list[dict[str, Any]] = []

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append({"city": city})
        return f"It is sunny and 21 C in {city}."

    llm = ChatOpenAI(base_url=url, api_key="unused", model=model_name(url), max_tokens=MAX_TOKENS,
                     streaming=stream)
    # Call the tool first; once its result is in, answer from it.
    app = tool_graph(llm.bind_tools([get_weather], tool_choice="required"), llm, get_weather)
    inputs = {"messages": [HumanMessage("What is the weather in Paris?")]}
    chunks = 0
    if stream:
        final: dict[str, Any] = {}
        for mode, payload in app.stream(inputs, stream_mode=["messages", "values"]):
            if mode == "messages":
                chunks += 1
            else:
                final = payload
        return final["messages"], calls, chunks
    return app.invoke(inputs)["messages"], calls, chunks


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
def test_langgraph_tool_agent(server_url: str, stream: bool) -> None:
    from langchain_core.messages import AIMessage, ToolMessage

    messages, calls, chunks = run_langgraph_agent(server_url, stream)
    assert len(calls) == 1 and isinstance(calls[0]["city"], str) and calls[0]["city"].strip()
    first = messages[1]
    assert isinstance(first, AIMessage) and [c["name"] for c in first.tool_calls] == ["get_weather"]
    assert first.tool_calls[0]["args"] == calls[0]
    assert isinstance(messages[2], ToolMessage) and "sunny" in messages[2].content
    last = messages[-1]
    assert isinstance(last, AIMessage) and not last.tool_calls and last.content.strip()
    assert "<tool_call>" not in last.content
    if stream:
        assert chunks > 2


# ---- pydantic schemas, and tools beside an output type ---------------------------------------
# What agent frameworks send every day: a set (uniqueItems), Literal, Optional, nested models and
# Field constraints in the tools' arguments, and a response_format (the output type) beside tools.
# Every request must get a 200 under "auto" and "required"; the first tool result switches the
# agent to tool_choice "none", so the run ends in an answer of the output type either way.

class Place(BaseModel):
    city: str = Field(min_length=1, max_length=16)
    country: Optional[str] = Field(default=None, max_length=12)


class Forecast(BaseModel):
    city: str = Field(max_length=16)
    sky: Literal["sunny", "rainy", "cloudy"]
    celsius: int = Field(ge=-40, le=50)
    signs: set[Literal["wind", "sun", "rain"]]


class WeatherArgs(BaseModel):
    place: Place
    units: Literal["C", "F"] = "C"
    extras: set[Literal["uv", "wind"]] = Field(default_factory=set, max_length=2)


def run_typed_openai_agent(url: str, stream: bool, choice: str) -> tuple[Any, list[Any], list[int]]:
    from agents import (
        Agent,
        AgentHooks,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[Any] = []
    statuses: list[int] = []

    @function_tool
    def get_weather(place: Place, units: Literal["C", "F"], extras: set[Literal["uv", "wind"]]) -> str:
        """Get the current weather in a place."""
        calls.append((place, units, extras))
        return f"It is sunny and 21 C in {place.city}."

    class AnswerAfterResult(AgentHooks):
        async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: object) -> None:
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    async def record(response: httpx.Response) -> None:
        statuses.append(response.status_code)

    async def main() -> Any:
        http = httpx.AsyncClient(event_hooks={"response": [record]}, timeout=120)
        client = AsyncOpenAI(base_url=url, api_key="unused", http_client=http, max_retries=0)
        agent = Agent(name="weather", instructions="You answer questions about the weather.",
                      tools=[get_weather], hooks=AnswerAfterResult(), reset_tool_choice=False, output_type=Forecast,
                      model=OpenAIChatCompletionsModel(model=model_name(url), openai_client=client),
                      model_settings=ModelSettings(tool_choice=choice, max_tokens=2 * MAX_TOKENS))
        if stream:
            result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        await client.close()
        return result

    return asyncio.run(main()), calls, statuses


@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
def test_openai_agents_sdk_typed_tools_and_output_type(server_url: str, stream: bool, choice: str) -> None:
    result, calls, statuses = run_typed_openai_agent(server_url, stream, choice)
    assert statuses and set(statuses) == {200}
    assert isinstance(result.final_output, Forecast)
    if choice == "required":
        assert len(calls) == 1
    for place, units, extras in calls:
        assert place.city and units in ("C", "F") and extras <= {"uv", "wind"}


def run_typed_langgraph(url: str, stream: bool, choice: str) -> tuple[list[Any], list[Any]]:
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    calls: list[Any] = []
    @tool(args_schema=WeatherArgs)
    def get_weather(place: Any, units: str = "C", extras: Any = None) -> str:
        """Get the current weather in a place."""
        calls.append((place, units, extras))
        return "It is sunny and 21 C."

    llm = ChatOpenAI(base_url=url, api_key="unused", model=model_name(url), max_tokens=4 * MAX_TOKENS,
                     streaming=stream)
    caller = llm.bind_tools([get_weather], tool_choice=choice, response_format=Forecast)
    answerer = llm.bind_tools([get_weather], tool_choice="none", response_format=Forecast)
    app = tool_graph(caller, answerer, get_weather)
    messages = app.invoke({"messages": [HumanMessage("What is the weather in Paris?")]})["messages"]
    return messages, calls


@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
def test_langgraph_typed_tools_and_output_type(server_url: str, stream: bool, choice: str) -> None:
    from langchain_core.messages import AIMessage

    messages, calls = run_typed_langgraph(server_url, stream, choice)  # a 400 would raise here
    last = messages[-1]
    assert isinstance(last, AIMessage) and not last.tool_calls
    Forecast.model_validate_json(last.content)
    if choice == "required":
        assert len(calls) == 1
