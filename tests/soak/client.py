"""The soak's HTTP side: one httpx client, a tally of what happened, and chat/SSE helpers.

Every request goes through `Client.send`, which counts it by status and flags any 5xx, so no
scenario can forget to. Anything a correct server would not do (a 5xx, a wrong status, wrong
scripted content, a stream without [DONE], an in-band error) is "unexpected" and fails the soak.
"""
from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

# Examples of unexpected outcomes kept for the report; the count is exact, the samples are not.
MAX_SAMPLES = 20


@dataclass
class Tally:
    http: Counter = field(default_factory=Counter)        # status code (or client-side end) -> requests
    scenarios: Counter = field(default_factory=Counter)   # scenario name -> runs
    faults: Counter = field(default_factory=Counter)      # injected fault kind -> count
    outcomes: Counter = field(default_factory=Counter)    # notable ends that are not faults or errors
    unexpected: Counter = field(default_factory=Counter)  # scenario name -> unexpected outcomes
    samples: list[str] = field(default_factory=list)
    server_5xx: int = 0
    inband_errors: int = 0
    hung: int = 0

    @property
    def requests(self) -> int:
        return sum(self.http.values())

    def fault(self, kind: str) -> None:
        self.faults[kind] += 1

    def wrong(self, scenario: str, what: str) -> None:
        self.unexpected[scenario] += 1
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append(f"{scenario}: {what}")


@dataclass
class Chat:
    """A chat response, streamed or not, in one shape."""
    status: int
    content: str = ""
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    session_id: str | None = None
    error: Any = None  # the error body of a non-2xx, or an in-band SSE error
    done: bool = False  # streams: saw data: [DONE]

    def assistant_message(self) -> dict[str, Any]:
        """What an OpenAI client appends to its history (message.model_dump(exclude_none=True))."""
        message: dict[str, Any] = {"role": "assistant"}
        if self.content or not self.tool_calls:
            message["content"] = self.content
        if self.tool_calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.tool_calls]
        return message


class Client:
    def __init__(self, base_url: str, concurrency: int, tally: Tally, rng: random.Random) -> None:
        # Headroom over the workers' count: disconnect scenarios leave connections closing.
        limits = httpx.Limits(max_connections=2 * concurrency + 8, max_keepalive_connections=concurrency)
        self.http = httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(120.0))
        self.tally = tally
        self.rng = rng
        self.counter = 0

    def unique(self) -> int:
        # Distinct prompts, so that the prefix cache shares the system prompt but not whole requests.
        self.counter += 1
        return self.counter

    async def aclose(self) -> None:
        await self.http.aclose()

    def record(self, status: int | str) -> None:
        self.tally.http[str(status)] += 1
        if isinstance(status, int) and status >= 500:
            self.tally.server_5xx += 1

    async def send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request read to the end; client-side timeouts and cancellations are counted by the caller."""
        response = await self.http.request(method, path, **kwargs)
        self.record(response.status_code)
        return response

    async def chat(self, body: dict[str, Any], got_status: list[int] | None = None) -> Chat:
        """POST /v1/chat/completions, streamed when body["stream"], read to the end. `got_status`
        receives the status as soon as it is known (for callers that may cancel mid-response)."""
        got_status = [] if got_status is None else got_status
        kwargs: dict[str, Any] = {"json": body}
        if not body.get("stream"):
            r = await self.send("POST", "/v1/chat/completions", **kwargs)
            got_status.append(r.status_code)
            data = _json(r)
            if r.status_code != 200:
                return Chat(r.status_code, error=data)
            choice = data["choices"][0]
            msg = choice["message"]
            return Chat(200, msg.get("content") or "", choice["finish_reason"], msg.get("tool_calls") or [],
                        data.get("session_id"), done=True)
        async with self.http.stream("POST", "/v1/chat/completions", **kwargs) as r:
            self.record(r.status_code)
            got_status.append(r.status_code)
            if r.status_code != 200:
                await r.aread()
                return Chat(r.status_code, error=_json(r))
            chat = Chat(200)
            async for event in sse_events(r):
                absorb(chat, event)
            if chat.error is not None:
                self.tally.inband_errors += 1
            return chat


async def sse_events(response: httpx.Response) -> Any:
    """The JSON payload of each `data:` line; the string "[DONE]" for the end marker."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        yield payload if payload == "[DONE]" else json.loads(payload)


def absorb(chat: Chat, event: Any) -> None:
    if event == "[DONE]":
        chat.done = True
        return
    if "error" in event:
        chat.error = event["error"]
        return
    chat.session_id = event.get("session_id") or chat.session_id
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        chat.content += delta.get("content") or ""
        chat.tool_calls.extend(delta.get("tool_calls") or ())
        chat.finish_reason = choice.get("finish_reason") or chat.finish_reason


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return {"unparsed": r.text[:200]}
