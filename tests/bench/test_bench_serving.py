"""`segue bench serving` against a stub OpenAI server that fails some requests: throughput counts
only the requests that were answered (a failed request's prompt was never served)."""
from __future__ import annotations

import asyncio
import itertools
import json
from typing import AsyncIterator, Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from segue.bench.serving import RowShape, run_row
from server_helpers import ServerThread


def _stub_app() -> Starlette:
    """Every third request succeeds, one fails with a 500, one with an error event in its stream."""
    counter = itertools.count()

    async def completions(request: Request) -> Response:
        body = await request.json()
        n = next(counter)
        if n % 3 == 1:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)

        async def events() -> AsyncIterator[str]:
            yield "data: " + json.dumps({"choices": [{"index": 0, "text": "x"}]}) + "\n\n"
            if n % 3 == 2:
                yield "data: " + json.dumps({"error": {"message": "engine died", "type": "server_error"}}) + "\n\n"
            else:
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture
def stub_url() -> Iterator[str]:
    app = _stub_app()
    with ServerThread(app, uvicorn.Config(app, log_level="warning")) as server:
        yield server.url + "/v1"


def test_failed_requests_count_as_errors_and_not_as_input(stub_url: str) -> None:
    # One at a time, so the stub's counter decides which requests fail: 0, 3, 6 succeed.
    shape = RowShape(num_prompts=9, input_len=20, output_len=4, concurrency=1)
    r = asyncio.run(run_row(stub_url, "stub", "single", vocab=500, seed=0, shape=shape))
    assert r.errors == 6  # three 500s and three error events inside a 200 stream
    assert r.input_tokens == 3 * 20
    assert r.output_tokens == 3 * 4
    assert r.input_tok_s == pytest.approx(r.input_tokens / r.duration_s)
