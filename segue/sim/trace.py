"""A scripted request's segments for trace replay (InferCept's workloads): generate N tokens, pause
for T seconds, append M tokens, and so on. segue/sim/script.py replays them through the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

# The kind of a pause that ends a turn: a client's next message continues the request (a session
# on the server), not a tool result; the engine pauses it as a turn end (Interception.turn_end).
TURN = "turn"


@dataclass
class TraceSegment:
    generate_tokens: int
    # None for the last segment: the request finishes after generating.
    interception_s: float | None = None
    append_tokens: list[int] = field(default_factory=list)
    kind: str | None = None  # the tool or augmentation kind, for statistics
