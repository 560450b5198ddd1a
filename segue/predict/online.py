"""The engine's predictors: what it calls at arrival, after a step, at an interception, at a
resume and at the end of a request, and what it reads for metrics.

A request's life is a series of segments, each the generation up to its next interception or its
end (LAMPS §4.2, multi-API). When a segment begins (arrival, resume) the output-length predictor
guesses its length from prompt features; when its prefill completes and the executor can return
hidden states, a second regressor over the last prompt token's hidden state (TRAIL) refines the
guess. When the segment ends both learn its true length. Interception durations are predicted
when the segment begins (from the request's previous tool, if any) and again once the tool is
known, and scored against the measured pause at resume.

Predictions go to `Request.predicted_output_tokens` (tokens the whole segment generates, counted
from its start) and `Request.predicted_interception_s`, after the optional noise injection; the
accuracy metrics score exactly what the policies were shown.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from segue.config import PredictorConfig
from segue.executor.base import SampledToken
from segue.predict.accuracy import AccuracySnapshot, AccuracyTracker
from segue.predict.features import PROMPT_FEATURE_DIM, RandomProjection, SegmentContext, prompt_features
from segue.predict.noise import GaussianNoise
from segue.predict.output_length import OutputLengthPredictor
from segue.predict.tool_duration import ToolDurationPredictor
from segue.request import Request
from segue.sched.output import ScheduledSeq
from segue.tools.stats import DurationStats

OUTPUT_PROMPT = "output_tokens_prompt"
OUTPUT_HIDDEN = "output_tokens_hidden"
TOOL_DURATION = "tool_duration"


@dataclass
class _OpenSegment:
    start_generated: int  # the request's generated tokens when the segment began
    prompt_x: np.ndarray
    prompt_pred: float | None
    hidden_x: np.ndarray | None = None
    hidden_pred: float | None = None
    wants_hidden: bool = False


@dataclass
class _LiveRequest:
    """What the predictors remember of one live request."""
    segment: _OpenSegment | None
    hint_s: float | None  # the client's expected tool duration (wins over statistics)
    last_tool: str | None = None
    interception_pred: float | None = None  # the duration prediction in force when it paused


class OnlinePredictors:
    def __init__(self, config: PredictorConfig, tool_stats: DurationStats, executor: Any = None) -> None:
        """`executor` supplies hidden states (Executor.want_hidden_states) when it can; without one,
        or when it cannot (the simulator), prompt features are the only source."""
        config.validate()
        self.config = config
        self.enabled = config.enabled
        self.executor = executor
        self.output_prompt = OutputLengthPredictor(PROMPT_FEATURE_DIM, config.window, config.ridge_alpha)
        self.output_hidden = OutputLengthPredictor(config.hidden_dims + PROMPT_FEATURE_DIM, config.window,
                                                   config.ridge_alpha)
        self.projection = RandomProjection(config.hidden_dims, config.seed)
        self.tool_duration = ToolDurationPredictor(tool_stats, config.tool_quantile)
        self.noise = GaussianNoise(config.noise_sigma, config.seed)
        self.accuracy = {name: AccuracyTracker(name) for name in (OUTPUT_PROMPT, OUTPUT_HIDDEN, TOOL_DURATION)}
        # Asking for no request probes whether the executor can return hidden states at all.
        self.use_hidden = (self.enabled and not config.oracle and config.feature_source == "hidden"
                           and executor is not None and bool(executor.want_hidden_states(())))
        self._tracks: dict[str, _LiveRequest] = {}

    # ---- lifecycle hooks (the engine calls these) -----------------------------------------
    def on_arrival(self, request: Request, hint_s: float | None = None) -> None:
        if not self.enabled:
            return
        track = self._tracks[request.request_id] = _LiveRequest(None, hint_s)
        self._begin_segment(request, track, 0)

    def request_hidden_states(self, seqs: Iterable[ScheduledSeq]) -> None:
        """Before a step: ask the executor for the hidden state of every scheduled sequence whose
        segment prefill completes in this step and still lacks its hidden-state feature."""
        if not self.use_hidden:
            return
        wanted = []
        for seq in seqs:
            track = self._tracks.get(seq.request.request_id)
            if seq.sample and track is not None and track.segment is not None and track.segment.wants_hidden:
                wanted.append(seq.request.request_id)
        if wanted:
            self.executor.want_hidden_states(wanted)

    def on_sampled(self, seqs: Iterable[ScheduledSeq], sampled: dict[str, SampledToken]) -> None:
        """After a step: take the hidden states the executor attached."""
        if not self.use_hidden:
            return
        for seq in seqs:
            token = sampled.get(seq.request.request_id)
            if token is not None and token.hidden is not None:
                self.on_hidden_state(seq.request, token.hidden)

    def on_hidden_state(self, request: Request, hidden: np.ndarray) -> None:
        """The final hidden state of the segment's last prompt token: refine the prediction."""
        track = self._tracks.get(request.request_id)
        if track is None or track.segment is None or not track.segment.wants_hidden:
            return
        seg = track.segment
        seg.wants_hidden = False
        seg.hidden_x = np.concatenate([self.projection(hidden), seg.prompt_x])
        pred = self.output_hidden.predict(seg.hidden_x, self._remaining(request, seg))
        if pred is not None:
            seg.hidden_pred = self.noise.apply(pred)
            request.predicted_output_tokens = seg.hidden_pred

    def on_intercept(self, request: Request, tool: str | None, hint_s: float | None = None) -> None:
        """The request just paused: learn its segment, predict the pause now that the tool is known."""
        track = self._tracks.get(request.request_id)
        if track is None:
            return
        self._end_segment(request, track)
        track.last_tool = tool
        self._set_interception(request, track, tool, hint_s)

    def on_resume(self, request: Request, num_appended: int, now: float) -> None:
        """Before the scheduler resumes the request (its interception still open)."""
        track = self._tracks.get(request.request_id)
        if track is None:
            return
        # Pauses that bypass LLMEngine.intercept (the scheduler's own pause at a stop) end here.
        self._end_segment(request, track)
        interception = request.interception
        if interception is not None:
            actual = max(0.0, now - interception.t_call)
            self.tool_duration.observe(actual)
            if track.interception_pred is not None:
                self.accuracy[TOOL_DURATION].record(track.interception_pred, actual)
        self._begin_segment(request, track, num_appended)

    def on_finish(self, request: Request) -> None:
        """The request ended normally: its last segment is a true length."""
        track = self._tracks.pop(request.request_id, None)
        if track is not None:
            self._end_segment(request, track)

    def forget(self, request_id: str) -> None:
        """Aborted or cut short: its lengths say nothing about what it would have generated."""
        self._tracks.pop(request_id, None)

    # ---- reading --------------------------------------------------------------------------
    def snapshot(self) -> dict[str, AccuracySnapshot]:
        return {name: tracker.snapshot() for name, tracker in self.accuracy.items()}

    @property
    def num_tracked(self) -> int:
        return len(self._tracks)

    # ---- internals ------------------------------------------------------------------------
    def _remaining(self, request: Request, seg: _OpenSegment) -> int | None:
        # What max_tokens still allows this segment, counted from its start.
        if not self.config.clip_to_max_tokens:
            return None
        return request.sampling_params.max_tokens - seg.start_generated

    def _begin_segment(self, request: Request, track: _LiveRequest, num_appended: int) -> None:
        ctx = SegmentContext(
            num_prompt_tokens=request.num_prompt_tokens,
            num_context_tokens=request.num_tokens + num_appended,
            segment_index=len(request.interceptions),
            num_appended_tokens=num_appended,
            num_generated_tokens=request.num_generated_tokens,
            previous_tool=track.last_tool)
        x = prompt_features(ctx)
        seg = _OpenSegment(request.num_generated_tokens, x, None, wants_hidden=self.use_hidden)
        pred = self.output_prompt.predict(x, self._remaining(request, seg))
        if pred is not None:
            seg.prompt_pred = self.noise.apply(pred)
        track.segment = seg
        request.predicted_output_tokens = seg.prompt_pred
        # The next pause probably calls the same tool as the last one did.
        self._set_interception(request, track, track.last_tool, track.hint_s)

    def _set_interception(self, request: Request, track: _LiveRequest, tool: str | None, hint_s: float | None) -> None:
        pred = self.tool_duration.predict(tool, hint_s if hint_s is not None else track.hint_s)
        track.interception_pred = self.noise.apply(pred) if pred is not None else None
        request.predicted_interception_s = track.interception_pred

    def _end_segment(self, request: Request, track: _LiveRequest) -> None:
        seg = track.segment
        if seg is None:
            return
        track.segment = None
        actual = request.num_generated_tokens - seg.start_generated
        if seg.prompt_pred is not None:
            self.accuracy[OUTPUT_PROMPT].record(seg.prompt_pred, actual)
        if seg.hidden_pred is not None:
            self.accuracy[OUTPUT_HIDDEN].record(seg.hidden_pred, actual)
        self.output_prompt.observe(seg.prompt_x, actual)
        if seg.hidden_x is not None:
            self.output_hidden.observe(seg.hidden_x, actual)
