"""Scripted requests for trace replay (InferCept's workloads): generate N tokens, pause for T
seconds, append M tokens, and so on. The benchmark and the simulator drive the engine with them."""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from segue.request import Request


@dataclass
class TraceSegment:
    generate_tokens: int
    # None for the last segment: the request finishes after generating.
    interception_s: float | None = None
    append_tokens: list[int] = field(default_factory=list)
    kind: str | None = None  # the tool or augmentation kind, for statistics


@dataclass
class _Script:
    segments: list[TraceSegment]
    index: int = 0
    # Generated-token count at which the current segment ends.
    boundary: int = 0


class TraceReplayer:
    """Tracks where each scripted request is in its script and when paused ones come back."""

    def __init__(self) -> None:
        self._scripts: dict[str, _Script] = {}
        self._due: list[tuple[float, int, str]] = []
        self._counter = 0

    def add(self, request_id: str, segments: list[TraceSegment]) -> int:
        """Registers a script; returns the total generated tokens (the request's max_tokens)."""
        if not segments or any(s.generate_tokens < 1 for s in segments):
            raise ValueError("every trace segment must generate at least one token")
        self._scripts[request_id] = _Script(segments, 0, segments[0].generate_tokens)
        return sum(s.generate_tokens for s in segments)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._scripts

    def pause_due(self, request_id: str, num_generated: int) -> TraceSegment | None:
        """The segment whose interception starts now, if the request just reached its boundary."""
        script = self._scripts.get(request_id)
        if script is None or num_generated != script.boundary:
            return None
        seg = script.segments[script.index]
        if seg.interception_s is None or script.index + 1 >= len(script.segments):
            return None
        return seg

    def current_segment(self, request_id: str) -> TraceSegment | None:
        """The segment a scripted request is generating (or paused at the end of)."""
        script = self._scripts.get(request_id)
        return script.segments[script.index] if script is not None else None

    def predict_truth(self, request: Request, noise: Callable[[float], float]) -> None:
        """Oracle predictions (PredictorConfig.oracle): the current segment's length and pause,
        through `noise`; a final segment has no pause, predicted as 0 s."""
        seg = self.current_segment(request.request_id)
        if seg is not None:
            request.predicted_output_tokens = max(1.0, noise(float(seg.generate_tokens)))
            request.predicted_interception_s = max(0.0, noise(seg.interception_s or 0.0))

    def schedule_resume(self, request_id: str, at: float) -> None:
        self._counter += 1
        heapq.heappush(self._due, (at, self._counter, request_id))

    def pop_due(self, now: float) -> list[tuple[str, list[int]]]:
        """Requests whose interception has ended, with the tokens to append."""
        out = []
        while self._due and self._due[0][0] <= now:
            _, _, rid = heapq.heappop(self._due)
            script = self._scripts.get(rid)
            if script is None:
                continue  # finished or aborted meanwhile
            seg = script.segments[script.index]
            script.index += 1
            script.boundary += script.segments[script.index].generate_tokens
            out.append((rid, list(seg.append_tokens)))
        return out

    def next_due(self) -> float | None:
        return self._due[0][0] if self._due else None

    def remove(self, request_id: str) -> None:
        self._scripts.pop(request_id, None)
