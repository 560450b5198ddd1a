"""What Scheduler.update_from_output says happened to each request that got a token this step.

The scheduler decides what it can see from token ids alone (EOS and stop token ids, max_tokens,
the context window, and whether such an end of a turn pauses the request instead of finishing
it) and reports it here; the engine relays it and never asks again. Decisions that need text
(stop strings, tool calls) are the engine's output processor's (segue/engine/output_processor.py).
The vocabulary is vLLM's: EngineCoreOutput carries finish_reason and stop_reason.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from segue.request import Request


class Outcome(enum.Enum):
    # Generates on (the engine may still end or pause it at a stop string or a tool call).
    RUNNING = "running"
    # Finished for good, its KV freed (a stop token, max_tokens, the context window).
    FINISHED = "finished"
    # The turn ended (a stop with pause_on_stop, max_tokens with pause_on_length) but the request
    # is paused, its context kept for the next turn; its output reads as finished.
    TURN_END = "turn_end"


@dataclass(frozen=True)
class RequestUpdate:
    request: Request
    outcome: Outcome
    # Why it finished or its turn ended: "stop" or "length" (RequestStatus.finish_reason); None
    # while running. The stop token id, if one stopped it, is the request's stop_reason.
    finish_reason: str | None = None
