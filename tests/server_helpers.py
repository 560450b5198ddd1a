"""Helpers for the server tests (no tests here): a live uvicorn server in a thread, a tiny engine, and
a scripted model that makes a random checkpoint emit tool calls and answers on cue.

A random tiny model never writes `<tool_call>` by itself, so ScriptedModel wraps the executor: the
real forward pass still runs (KV writes, batching, everything the engine does), then the sampled
token of every request whose prompt carries a script marker is replaced by the script's next token.
Script segment i is what the model writes after the i-th interception; past its end comes EOS.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import socket
import threading
import time
from typing import Any, Callable, Iterator

import uvicorn

import engine_helpers
from conftest import default_tokenizer, make_tiny_checkpoint
from segue.engine.async_engine import AsyncLLMEngine
from segue.engine.llm_engine import LLMEngine
from segue.executor.base import SampledToken
from segue.sched.output import SchedulerOutput


class ServerThread:
    """uvicorn on 127.0.0.1 in a background thread, on a socket bound before start (no port race)."""

    def __init__(self, app: Any, config: uvicorn.Config | None = None) -> None:
        """`config`: uvicorn's settings for `app` (default: quiet, with lifespan events)."""
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(config or uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def make_async_engine(directory: pathlib.Path, policy: str = "preserve", context: int = 2048,
                      kv_cache_tokens: int = 8192, swap_space_tokens: int = 4096) -> AsyncLLMEngine:
    """A tiny random Llama whose context fits a tool prompt (the checkpoint's own is 512)."""
    path = make_tiny_checkpoint(directory / "tiny-llama")
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = context
    config_file.write_text(json.dumps(config))
    return AsyncLLMEngine(engine_helpers.make_engine(path, policy=policy, kv_tokens=kv_cache_tokens,
                                                    swap_tokens=swap_space_tokens))


def encode(text: str) -> list[int]:
    return default_tokenizer().encode(text, add_special_tokens=False)


def call_text(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@dataclasses.dataclass
class Seen:
    """What the executor saw of one request: (start position, tokens) of every scheduled chunk."""
    chunks: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)

    def text(self) -> str:
        return default_tokenizer().decode([t for _, chunk in self.chunks for t in chunk])


class ScriptedModel:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.real = engine.executor.execute
        self.eos = engine.model_config.eos_token_ids[0]
        self.scripts: dict[str, list[list[int]]] = {}
        self.seen: dict[str, Seen] = {}
        self._chosen: dict[str, str | None] = {}
        self._progress: dict[str, tuple[int, int]] = {}
        self.delay_s = 0.0

    def script(self, marker: str, *segments: str) -> None:
        """Requests whose prompt contains `marker` write `segments` (one per interception)."""
        self.scripts[marker] = [encode(s) for s in segments]

    def _marker(self, request: Any) -> str | None:
        rid = request.request_id
        if rid not in self._chosen:
            prompt = default_tokenizer().decode(request.prompt_token_ids)
            self._chosen[rid] = next((m for m in self.scripts if m in prompt), None)
        return self._chosen[rid]

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        if self.delay_s:
            time.sleep(self.delay_s)
        sampled = self.real(out)
        for seq in out.seqs:
            req = seq.request
            rid = req.request_id
            self.seen.setdefault(rid, Seen()).chunks.append((seq.start_pos, list(seq.token_ids)))
            marker = self._marker(req)
            if not seq.sample or marker is None:
                continue
            segment = len(req.interceptions)
            seg, pos = self._progress.get(rid, (segment, 0))
            if seg != segment:
                seg, pos = segment, 0
            tokens = self.scripts[marker][seg] if seg < len(self.scripts[marker]) else []
            token = tokens[pos] if pos < len(tokens) else self.eos
            self._progress[rid] = (seg, pos + 1)
            assert isinstance(sampled[rid], SampledToken)
            sampled[rid] = dataclasses.replace(sampled[rid], token_id=token)
        return sampled

    def seen_with(self, marker: str) -> list[tuple[str, Seen]]:
        """(request id, what the executor saw) of the requests scripted by `marker`, oldest first."""
        return [(rid, self.seen[rid]) for rid, m in self._chosen.items() if m == marker and rid in self.seen]


def on_engine(engine: AsyncLLMEngine, fn: Callable[[LLMEngine], Any]) -> Any:
    """Run fn on the engine thread between steps, from a test thread."""
    async def go() -> Any:
        return await engine.run_sync(fn)
    return asyncio.run(go())


def install_script(engine: AsyncLLMEngine) -> ScriptedModel:
    def install(e: LLMEngine) -> ScriptedModel:
        model = ScriptedModel(e)
        e.executor.execute = model.execute  # type: ignore[method-assign]
        return model
    return on_engine(engine, install)


def engine_stats(engine: AsyncLLMEngine) -> tuple[int, int]:
    """(KV blocks held, unfinished requests)."""
    return on_engine(engine, lambda e: (e.scheduler.state.kv.num_held_blocks(), e.num_unfinished_requests))


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def wait_idle(engine: AsyncLLMEngine, timeout: float = 10.0) -> None:
    """Nothing running, nothing held, and the KV invariants hold."""
    wait_until(lambda: engine_stats(engine) == (0, 0), timeout, f"an idle engine (now {engine_stats(engine)})")
    on_engine(engine, lambda e: e.check_invariants())


def num_paused(engine: AsyncLLMEngine) -> int:
    return on_engine(engine, lambda e: len(e.scheduler.state.paused.paused))


def shutdown(engine: AsyncLLMEngine) -> None:
    asyncio.run(engine.shutdown())


def engine_fixture(tmp_factory: Any, policy: str = "preserve") -> Iterator[tuple[AsyncLLMEngine, ScriptedModel]]:
    engine = make_async_engine(tmp_factory.mktemp("server"), policy)
    yield engine, install_script(engine)
    shutdown(engine)
