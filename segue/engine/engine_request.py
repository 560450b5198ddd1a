"""EngineRequest: everything a caller hands the engine to start one request, as one value.

Named after vLLM's EngineCoreRequest (what its front end sends the engine core) and playing the
part of mini-sglang's UserMsg: the server, programs, benchmarks and the simulator build one, and it
travels unchanged through EngineClient.generate, the pool, a replica (pickled into a Ray actor)
and the async engine to RequestFactory.make_request, which validates it and turns it into the
scheduler's Request (segue/request.py: the live state of a request, which this is not).

It is plain data: the prompt, the sampling settings, an optional id, the scheduling hints
(RequestHints) and the format of the tool calls to pause at, by value (a ToolCallFormat, never a
parser object: the engine builds its own parser from it). Frozen: a layer that fills something
in (the pool names the id and sends token ids) makes a new one with dataclasses.replace.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field

from segue.sampling_params import SamplingParams
from segue.tools.call_format import ToolCallFormat


@dataclass(frozen=True)
class RequestHints:
    """How a request would like to be scheduled and placed; none of them changes its tokens."""
    # vLLM's convention: lower values run first under the policies that read it.
    priority: int = 0
    # The program (agent, session) the request belongs to: policies and routers keep its calls together.
    program_id: str | None = None
    # Requests share cached prefix blocks only with equal salts (tenant isolation).
    cache_salt: str | None = None
    # The client's estimate of how long its tool calls take (extra_body expected_tool_seconds).
    expected_tool_s: float | None = None
    # False for a program call that serves throughput (see Request.latency_sensitive).
    latency_sensitive: bool = True
    # Calls that run best side by side: a pool places them on one replica; one engine ignores it.
    task_group: str | None = None


@dataclass(frozen=True)
class EngineRequest:
    prompt: str | list[int]
    params: SamplingParams
    # None: the engine draws one.
    request_id: str | None = None
    _: KW_ONLY
    hints: RequestHints = field(default_factory=RequestHints)
    # Pause when the output completes a call in this format (the caller runs the tool and
    # resumes); None: never look for tool calls.
    tool_format: ToolCallFormat | None = None
    # On the engine's clock (time.monotonic in its process); None: when the engine makes it.
    # Only drivers in the engine's process set it (the simulator's scheduled arrivals).
    arrival_time: float | None = None
