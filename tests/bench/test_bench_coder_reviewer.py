"""The coder/reviewer workloads of `segue bench programs` against a live server with a tiny random model:
both clients run the same loop, and the program's calls read the shared task from the prefix cache."""
from __future__ import annotations

from typing import Any, Iterator

import pytest

from segue.bench.program_workloads import coder_reviewer_baseline, coder_reviewer_program
from segue.server.app import create_app
from server_helpers import ServerThread, make_async_engine, shutdown, wait_idle

ROUNDS, N = 2, 4
# About 460 tokens: many KV blocks of shared context, well within the tiny model's 2048-token context.
TASK = "Implement the stream decoder described here. " + " ".join(f"step{i} checks field{i}." for i in range(60))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    engine = make_async_engine(tmp_path_factory.mktemp("coder-reviewer"))
    with ServerThread(create_app(engine)) as s:
        yield s.url, engine
    shutdown(engine)


def test_program_and_baseline_run_the_same_loop(server: tuple[str, Any]) -> None:
    url, engine = server
    program_calls: list[dict[str, Any]] = []
    baseline_calls: list[dict[str, Any]] = []
    assert coder_reviewer_program(url, TASK, ROUNDS, N, 0.0, program_calls) > 0
    assert coder_reviewer_baseline(url, TASK, ROUNDS, N, 0.0, baseline_calls) > 0
    wait_idle(engine)
    assert len(program_calls) == len(baseline_calls) == 2 * ROUNDS
    assert all(c["status"] == "done" for c in program_calls)
    # Each call after the first starts with the task, whose KV an earlier call left in the cache.
    first, *rest = program_calls
    assert first["cached_tokens"] == 0 and first["prompt_tokens"] > 256
    for call in rest:
        assert call["cached_tokens"] >= 256, call
    # The same prompts up to tokenization: the program tokenizes segment by segment, the baseline the
    # rendered text, and the generated text in them differs by how it was stripped and re-encoded.
    for p, b in zip(program_calls, baseline_calls, strict=True):
        assert abs(p["prompt_tokens"] - b["prompt_tokens"]) <= N + 4
