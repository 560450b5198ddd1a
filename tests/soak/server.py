"""The server under soak: a tiny random Llama behind the real app on 127.0.0.1, with operator tools
that succeed, raise and hang, and a scripted model so that marked prompts make tool calls.

It reuses the server tests' helpers (server_helpers): the live uvicorn thread, the tiny engine
and the ScriptedModel. Those keep per-request records forever, which is right for a test that reads
them back and wrong for thousands of requests whose memory we measure, so SoakScript prunes them.
"""
from __future__ import annotations

import pathlib
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

# server_helpers imports `conftest` as a top-level module, as pytest does: put tests/ on the
# path so `python -m tests.soak.run` finds both the way pytest does.
_TESTS = pathlib.Path(__file__).resolve().parents[1]
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

import server_helpers as support  # noqa: E402
from segue.engine.async_engine import AsyncLLMEngine  # noqa: E402
from segue.engine.llm_engine import LLMEngine  # noqa: E402
from segue.executor.base import SampledToken  # noqa: E402
from segue.sched.output import SchedulerOutput  # noqa: E402
from segue.server.app import create_app  # noqa: E402
from segue.server.config import ServerConfig  # noqa: E402
from segue.tools.registry import ToolRegistry  # noqa: E402
from segue.tools.spec import ToolSpec  # noqa: E402

# The hanging tool sleeps well past its timeout, so every call of it is a timeout the runner must
# turn into an error result while the tool's thread is still asleep.
STALL_TIMEOUT_S = 0.25
STALL_SLEEP_S = 1.0
# How often (in engine steps) SoakScript drops the records of requests the engine no longer has.
PRUNE_EVERY_STEPS = 256

# The client-side tool of session scenarios: a call to it ends the response and opens a session.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# marker -> (what the model writes before each interception..., the final answer), and the content
# the client must get back (server-side calls are invisible to it; client calls end the turn).
SCRIPTS: dict[str, tuple[str, ...]] = {
    "[tool-ok]": (support.call_text("lookup", {"key": "alpha"}), "Found it."),
    "[tool-fail]": ("Trying. " + support.call_text("explode", {}), "Recovered."),
    "[tool-stall]": (support.call_text("stall", {}), "Gave up."),
    "[chain]": (support.call_text("lookup", {"key": "beta"}), support.call_text("explode", {}), "Done."),
    "[client]": ("Checking. " + support.call_text("get_weather", {"city": "Paris"}), "It is sunny."),
}
EXPECTED_CONTENT = {"[tool-ok]": "Found it.", "[tool-fail]": "Trying. Recovered.", "[tool-stall]": "Gave up.",
                    "[chain]": "Done.", "[client]": "Checking. "}
RESUMED_CONTENT = "It is sunny."


def lookup(key: str) -> str:
    return f"value of {key}"


def explode(**_: Any) -> str:
    raise RuntimeError("injected failure")


def stall(**_: Any) -> str:
    time.sleep(STALL_SLEEP_S)
    return "too late"


def soak_tools() -> ToolRegistry:
    empty = {"type": "object", "properties": {}}
    tools = ToolRegistry()
    tools.register(ToolSpec(name="lookup", description="Look a key up.", timeout_s=5.0, parameters={
        "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}), lookup)
    tools.register(ToolSpec(name="explode", description="Always fails.", parameters=empty), explode)
    # max_concurrency above the soak's concurrency: the point is the timeout, not queueing.
    tools.register(ToolSpec(name="stall", description="Hangs.", parameters=empty, timeout_s=STALL_TIMEOUT_S,
                            max_concurrency=64), stall)
    return tools


class SoakScript(support.ScriptedModel):
    """ScriptedModel without its unbounded records: `seen` is never needed here, and the marker and
    progress of finished requests are dropped every PRUNE_EVERY_STEPS steps."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine)
        self._steps = 0

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        sampled = super().execute(out)
        self.seen.clear()
        self._steps += 1
        if self._steps % PRUNE_EVERY_STEPS == 0:
            live = self.engine.scheduler.state.requests
            for table in (self._chosen, self._progress):
                for rid in [rid for rid in table if rid not in live]:
                    del table[rid]
        return sampled


def install_soak_script(engine: AsyncLLMEngine) -> SoakScript:
    def install(e: LLMEngine) -> SoakScript:
        model = SoakScript(e)
        e.executor.execute = model.execute  # type: ignore[method-assign]
        for marker, segments in SCRIPTS.items():
            model.script(marker, *segments)
        return model
    return support.on_engine(engine, install)


def make_soak_engine(directory: pathlib.Path, policy: str, kv_cache_tokens: int, swap_space_tokens: int,
                     context: int = 2048) -> AsyncLLMEngine:
    """The test server's engine with a KV cache sized by the caller: the soak wants the device pool
    small enough that concurrent requests and held sessions force swaps and preemptions."""
    return support.make_async_engine(directory, policy, context, kv_cache_tokens, swap_space_tokens)


@dataclass
class ServerSettings:
    policy: str = "min-waste"
    # 128 device blocks: a full context (2048 tokens) still fits alone, but 16 concurrent requests
    # plus held sessions do not, so the scheduler must swap, discard and preempt.
    kv_cache_tokens: int = 2048
    swap_space_tokens: int = 4096
    concurrency: int = 16
    # Short enough that abandoned sessions expire during the run (and the final wait stays short).
    session_ttl_s: float = 3.0
    request_timeout_s: float = 30.0
    max_body_bytes: int = 256 * 1024


class SoakServer:
    """Context manager: engine, scripted model and live server; .url, .engine, .app, .ctx."""

    def __init__(self, settings: ServerSettings, directory: pathlib.Path | None = None) -> None:
        self.settings = settings
        self._tmp = None if directory is not None else tempfile.TemporaryDirectory(prefix="segue-soak-")
        self.directory = directory or pathlib.Path(self._tmp.name)  # type: ignore[union-attr]
        self.engine: AsyncLLMEngine | None = None
        self.thread: support.ServerThread | None = None

    def __enter__(self) -> "SoakServer":
        s = self.settings
        self.engine = make_soak_engine(self.directory, s.policy, s.kv_cache_tokens, s.swap_space_tokens)
        try:
            self.script = install_soak_script(self.engine)
            # Room above the client's concurrency: 429s would hide the faults we mean to inject.
            config = ServerConfig(max_concurrent_requests=max(64, 4 * s.concurrency),
                                  request_timeout_s=s.request_timeout_s, session_ttl_s=s.session_ttl_s,
                                  max_body_bytes=s.max_body_bytes)
            self.app = create_app(self.engine, config=config, tools=soak_tools())
            self.ctx = self.app.state.serving
            self.thread = support.ServerThread(self.app).__enter__()
        except BaseException:
            support.shutdown(self.engine)
            raise
        self.url = self.thread.url
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.thread is not None:
                self.thread.__exit__(*exc)
        finally:
            if self.engine is not None:
                support.shutdown(self.engine)
            if self._tmp is not None:
                self._tmp.cleanup()


def engine_probe(e: LLMEngine) -> dict[str, int]:
    """Runs on the engine thread between steps: everything that must be zero once the server is idle."""
    s = e.scheduler.state
    kv = s.kv
    swapping_out = kv.num_swapping_out_blocks
    return {
        "requests": len(s.requests), "running": len(s.running), "waiting": len(s.waiting),
        "paused": len(s.paused.paused), "swapped": len(s.paused.swapped),
        "held_device_blocks": kv.num_held_blocks(),
        # Blocks whose swap-out copy is in flight go back to the pool at the next step; counted apart.
        "device_used_blocks": kv.device.num_used_blocks - swapping_out - kv.num_retained_blocks,
        "swapping_out_blocks": swapping_out,
        # Finished turns' contexts kept for their agents' next turns (segue/sched/agents.py): held
        # by design until their agent is back, the usual gap has passed, or memory is needed.
        "retained_device_blocks": kv.num_retained_blocks,
        "host_table_blocks": sum(len(t) for t in kv.host_tables.values()),
        "host_used_blocks": kv.host.num_used_blocks if kv.host is not None else 0,
        "device_blocks_total": kv.device.num_blocks,
        # Counters, for the report: the soak is only as good as the pressure it put on the engine.
        "preemptions_total": s.num_preemptions_total, "steps_total": e.num_steps,
    }


def queue_dump(e: LLMEngine) -> list[str]:
    """Where every request is and what KV it holds: the evidence when the engine stops making progress."""
    s = e.scheduler.state
    kv = s.kv
    rows, empty = [], 0
    for rid, req in s.requests.items():
        device, host = kv.num_device_blocks_of(rid), kv.num_host_blocks_of(rid)
        if not device and not host:
            empty += 1  # queued with nothing held: not part of who holds the pool
            continue
        where = ("running" if req in s.running else "waiting" if req in s.waiting else
                 "paused" if rid in s.paused.paused else "swapped" if req in s.paused.swapped else "landing")
        rows.append(f"{where} {req.status.name} tokens={req.num_tokens} computed={req.num_computed_tokens} "
                    f"device_blocks={device} host_blocks={host}")
    return ([f"free device blocks {kv.num_free_blocks}/{kv.device.num_blocks}; running {len(s.running)}, "
             f"waiting {len(s.waiting)}, swapped {len(s.paused.swapped)}; holders of KV:"]
            + sorted(rows) + [f"({empty} more requests hold no KV)"])


async def server_probe(srv: SoakServer) -> dict[str, int]:
    """Engine state plus the server's own tables (read on the server's loop thread's objects; plain
    ints and lens, so reading them from another thread is safe enough for a snapshot)."""
    assert srv.engine is not None
    probe = await srv.engine.run_sync(engine_probe)
    probe.update(streams=srv.engine.num_unfinished_requests,
                 detached=len(getattr(srv.engine, "_detached", ())),
                 in_flight=srv.ctx.limiter.in_flight, sessions=len(srv.ctx.sessions))
    return probe  # type: ignore[return-value]


def is_idle(probe: dict[str, int]) -> bool:
    return all(probe[k] == 0 for k in ("requests", "streams", "in_flight", "sessions", "held_device_blocks",
                                       "host_table_blocks"))
