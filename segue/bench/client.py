"""Drive any OpenAI-compatible server (Segue, vLLM, ...) with a workload, open-loop, over HTTP.

Each workload request becomes one conversation of streamed chat completions, one call per segment:
the call generates the segment's tokens (max_tokens = segment length, `ignore_eos` so the count is
exact where the server accepts it: Segue and vLLM do), then the client emulates the interception by
waiting the trace's pause, appends the answer and a user message of about the appended token count,
and continues. Time between a call's last token and the next call is the request's intercepted
time, which normalized latency excludes (metrics.py). Messages are user messages rather than tool
results because a tool message needs a real tool call before it, which random prompts do not make.

On Segue the conversation also carries `program_id` (one per conversation, for program-level
policies) and a session (`open_session`, then `session_id`), closed at the end; other servers ignore
unknown fields. Segue holds a session turn that ends by length as a paused request (when the held
tokens re-render exactly), so the server's interception policy decides what the pause costs, as it
would for a tool call. The trace's pause length is not sent: the policy has to estimate it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from segue.bench.filler import TokenCalibration, filler_text
from segue.sim.metrics import RequestRecord, summarize
from segue.sim.workloads.trace_request import TraceRequest

logger = logging.getLogger(__name__)


@dataclass
class ClientConfig:
    base_url: str  # ends in /v1
    model: str | None = None  # default: the server's first model
    api_key: str | None = None
    ignore_eos: bool = True
    segue_extensions: bool = True  # program_id, open_session / session_id
    calibrate: bool = True
    timeout_s: float = 600.0
    seed: int = 0


@dataclass
class ClientResult:
    records: list[RequestRecord]
    num_requests: int
    duration_s: float
    wall_s: float
    errors: list[str] = field(default_factory=list)
    intended_prompt_tokens: int = 0
    calibration: TokenCalibration | None = None

    @property
    def num_finished(self) -> int:
        return len(self.records)

    def to_dict(self) -> dict[str, Any]:
        cal = self.calibration
        return {
            "num_requests": self.num_requests, "num_finished": self.num_finished,
            "num_unfinished": self.num_requests - self.num_finished, "stalled": False,
            "duration_s": self.duration_s, "wall_s": self.wall_s,
            "summary": summarize(self.records, self.duration_s).to_dict() if self.records else None,
            "errors": self.errors[:20], "num_errors": len(self.errors),
            # Prompt tokens the trace asked for vs. what the server counted (text is approximate).
            "intended_prompt_tokens": self.intended_prompt_tokens,
            "calibration": cal.__dict__ if cal else None,
        }


@dataclass
class _StreamedSegment:
    content: str
    first_token_time: float | None
    end_time: float
    prompt_tokens: int
    completion_tokens: int
    session_id: str | None
    # Prompt tokens the server answered from its prefix cache (usage.prompt_tokens_details).
    cached_tokens: int = 0


class ServerError(RuntimeError):
    pass


class OpenAIClient:
    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.http = httpx.AsyncClient(base_url=config.base_url.rstrip("/"), headers=headers,
                                      timeout=httpx.Timeout(config.timeout_s, connect=30.0),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.model = config.model
        self.calibration = TokenCalibration()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def setup(self) -> None:
        if self.model is None:
            r = await self.http.get("/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        if self.config.calibrate:
            self.calibration = await self._calibrate()

    async def _prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        r = await self.http.post("/chat/completions", json={
            "model": self.model, "messages": messages, "max_tokens": 1, "temperature": 0})
        if r.status_code != 200:
            raise ServerError(f"calibration request failed: {r.status_code} {r.text[:300]}")
        return int(r.json()["usage"]["prompt_tokens"])

    async def _calibrate(self) -> TokenCalibration:
        """Fit the text-to-token ratio and the template's overheads from three probes (these also warm
        the server up before the timed run)."""
        rng = np.random.default_rng(12345)
        short, long_ = filler_text(20, rng), filler_text(220, rng)
        p_short = await self._prompt_tokens([{"role": "user", "content": short}])
        p_long = await self._prompt_tokens([{"role": "user", "content": long_}])
        per_word = (p_long - p_short) / 200
        p_turn = await self._prompt_tokens([{"role": "user", "content": short}, {"role": "assistant", "content": "ok"},
                                            {"role": "user", "content": short}])
        return TokenCalibration(per_word=per_word, first_overhead=p_short - 20 * per_word,
                                turn_overhead=p_turn - p_short - 20 * per_word)

    def _body(self, messages: list[dict[str, str]], max_tokens: int, program_id: str,
              session_id: str | None, more_turns: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        if self.config.segue_extensions:
            body["program_id"] = program_id
            if session_id is not None:
                body["session_id"] = session_id
            elif more_turns:
                body["open_session"] = True
        return body

    async def _stream(self, body: dict[str, Any]) -> _StreamedSegment:
        content: list[str] = []
        first: float | None = None
        usage: dict[str, Any] = {}
        session_id: str | None = None
        async with self.http.stream("POST", "/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise ServerError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ServerError(f"error in stream: {chunk['error']}")
                session_id = chunk.get("session_id") or session_id
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        first = first or time.monotonic()
                        content.append(text)
        end = time.monotonic()
        if not usage:
            raise ServerError("the server sent no usage (stream_options.include_usage unsupported?)")
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return _StreamedSegment("".join(content), first, end, int(usage.get("prompt_tokens", 0)),
                        int(usage.get("completion_tokens", 0)), session_id, cached)

    async def conversation(self, index: int, req: TraceRequest, arrival: float) -> RequestRecord:
        """Replay one request starting at `arrival` (time.monotonic); returns its record."""
        cal = self.calibration
        rng = np.random.default_rng([self.config.seed, index])
        words = cal.words_for(req.prompt_tokens, cal.first_overhead)
        # Seeded by the index, so two draws of one trace request share no prefix beyond the template.
        messages = [{"role": "user", "content": filler_text(words, rng)}]
        program_id = f"bench-{self.config.seed}-{index}"
        session_id: str | None = None
        first_token: float | None = None
        prompt_tokens, output, intercepted = 0, 0, 0.0
        try:
            for s, (gen, pause, appended) in enumerate(req.segments):
                more = pause is not None
                seg = await self._stream(self._body(messages, gen, program_id, session_id, more))
                if s == 0:
                    prompt_tokens = seg.prompt_tokens
                    first_token = seg.first_token_time or seg.end_time
                session_id = seg.session_id or session_id
                output += seg.completion_tokens
                end = seg.end_time
                if pause is None:  # not `more`
                    break
                await asyncio.sleep(pause)
                follow = filler_text(cal.words_for(appended, cal.turn_overhead), rng)
                messages += [{"role": "assistant", "content": seg.content}, {"role": "user", "content": follow}]
                intercepted += time.monotonic() - end
        finally:
            if session_id is not None:
                await self._close_session(session_id)
        if output < 1 or first_token is None:
            raise ServerError(f"request {index} generated no tokens")
        return RequestRecord(arrival, max(first_token, arrival), end, prompt_tokens, output, intercepted)

    async def _close_session(self, session_id: str) -> None:
        r = await self.http.delete(f"/sessions/{session_id}")
        if r.status_code not in (200, 404):  # 404: expired already, nothing held
            logger.warning("closing session %s: HTTP %d", session_id, r.status_code)


async def drive(config: ClientConfig, requests: Sequence[TraceRequest], arrivals: Sequence[float],
                progress: bool = False, desc: str = "url", deadline_s: float | None = None) -> ClientResult:
    """Send requests[i] at start + arrivals[i], open-loop; wait for all (or the deadline)."""
    from tqdm import tqdm

    if len(requests) != len(arrivals):
        raise ValueError("one arrival time per request")
    client = OpenAIClient(config)
    records: list[RequestRecord] = []
    errors: list[str] = []
    bar = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr, disable=not progress,
               dynamic_ncols=True, mininterval=1.0)
    try:
        await client.setup()
        start = time.monotonic() + 0.05  # a moment to create the tasks before the first arrival

        async def one(i: int) -> None:
            at = start + arrivals[i]
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            try:
                records.append(await client.conversation(i, requests[i], at))
            except (ServerError, httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                errors.append(f"request {i}: {type(e).__name__}: {e}")
            bar.update(1)

        wall0 = time.perf_counter()
        tasks = [asyncio.create_task(one(i)) for i in range(len(requests))]
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            if t.exception() is not None:  # a bug, not a server failure: surface it
                raise t.exception()  # type: ignore[misc]
        wall = time.perf_counter() - wall0
    finally:
        bar.close()
        await client.aclose()
    duration = max((r.finish_time for r in records), default=start) - start
    return ClientResult(records, len(requests), duration, wall, errors,
                        sum(r.prompt_tokens for r in requests), client.calibration)


def drive_sync(config: ClientConfig, requests: Sequence[TraceRequest], arrivals: Sequence[float],
               **kwargs: Any) -> ClientResult:
    return asyncio.run(drive(config, requests, arrivals, **kwargs))
