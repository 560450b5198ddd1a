"""Trace replay inside the engine's step loop: scripted requests generate, pause for the recorded
tool time and resume with the recorded tokens; with oracle predictions (PredictorConfig.oracle) the
predictors are told each segment's true length and pause.

ScriptedRequests is the engine's StepHooks (segue/engine/hooks.py): the engine calls it before each
step and after each token, and it acts through the engine's public methods (intercept, resume,
finish_request). The engine itself knows nothing of scripts.
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Callable

from segue.engine.engine_request import EngineRequest
from segue.engine.llm_engine import LLMEngine
from segue.outputs import RequestOutput
from segue.request import Request, RequestStatus
from segue.sampling_params import SamplingParams
from segue.sim.trace import TURN, TraceSegment


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


class ScriptedRequests:
    """The engine's StepHooks for scripted requests (install with scripted(engine))."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.trace = TraceReplayer()

    def add_request(self, request: EngineRequest, script: list[TraceSegment]) -> Request:
        """A request that generates, pauses and resumes as `script` says (max_tokens becomes the
        script's total and EOS is ignored)."""
        total = sum(seg.generate_tokens for seg in script)
        params = SamplingParams(**{**request.params.__dict__, "max_tokens": total, "ignore_eos": True})
        state = self.engine.make_request(dataclasses.replace(request, params=params))
        # Before the engine adds it: oracle predictions at arrival read the script.
        self.trace.add(state.request.request_id, script)
        return self.engine.add_prepared(state)

    # ---- StepHooks -----------------------------------------------------------------------
    def before_step(self, now: float) -> list[RequestOutput]:
        ended = []
        for rid, tokens in self.trace.pop_due(now):
            held = self.engine.paused_token_ids(rid)
            if held is None:
                continue
            if len(held) + len(tokens) >= self.engine.max_model_len:
                # The script outgrows the context: end this request, not the step.
                out = self.engine.finish_request(rid, RequestStatus.FINISHED_LENGTH, now)
                if out is not None:
                    ended.append(out)
                continue
            self.engine.resume(rid, tokens)
        return ended

    def after_token(self, request_id: str, num_generated: int, now: float) -> bool:
        seg = self.trace.pause_due(request_id, num_generated)
        if seg is None:
            return False
        assert seg.interception_s is not None  # pause_due returns only segments that pause
        self.engine.intercept(request_id, seg.kind, turn_end=seg.kind == TURN)
        self.trace.schedule_resume(request_id, now + seg.interception_s)
        return True

    def after_prediction(self, request: Request) -> None:
        if self.engine.config.predictor.oracle:
            self.trace.predict_truth(request, self.engine.predictors.noise.apply)

    def on_request_end(self, request_id: str) -> None:
        self.trace.remove(request_id)

    def next_event(self) -> float | None:
        return self.trace.next_due()


def scripted(engine: LLMEngine) -> ScriptedRequests:
    """The engine's ScriptedRequests, installed as its hooks on first use."""
    if not isinstance(engine.hooks, ScriptedRequests):
        if engine.hooks is not None:
            raise ValueError(f"the engine already has other hooks: {engine.hooks!r}")
        engine.hooks = ScriptedRequests(engine)
    return engine.hooks
