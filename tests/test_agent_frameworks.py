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
from typing import Any, Iterator

import httpx
import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
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
    from agents import (Agent, AgentHooks, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)
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

def run_langgraph_agent(url: str, stream: bool) -> tuple[list[Any], list[dict[str, Any]], int]:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    calls: list[dict[str, Any]] = []

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append({"city": city})
        return f"It is sunny and 21 C in {city}."

    llm = ChatOpenAI(base_url=url, api_key="unused", model=model_name(url), max_tokens=MAX_TOKENS,
                     streaming=stream)
    caller = llm.bind_tools([get_weather], tool_choice="required")

    def agent(state: MessagesState) -> dict[str, Any]:
        # Call the tool first; once its result is in, answer from it.
        answered = isinstance(state["messages"][-1], ToolMessage)
        return {"messages": [(llm if answered else caller).invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([get_weather]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: END})
    graph.add_edge("tools", "agent")
    app = graph.compile()
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
