"""The step's output processing: turn what the scheduler says happened to each request that got a
token into that request's output, and make on the way the decisions that need text.

Who decides what about a request's token (one owner each):
- EOS, stop token ids, max_tokens, the context window, and whether such an end of a turn pauses
  the request (pause_on_stop, pause_on_length) instead of finishing it: the scheduler
  (Scheduler.update_from_output, which reports each as a RequestUpdate; relayed here, never
  asked again);
- a stop string, and a complete tool call in the detokenized text: OutputProcessor, here; a
  driver's scripted pause (StepHooks.after_token) comes before the tool-call check;
- carrying such a decision out, with one scheduler call to pause or stop and the predictors
  told of the pause or end: EngineRequests (engine/request_lifecycle.py: intercept, stop, retire);
- where a paused request's KV lives meanwhile: the scheduler's interception policy
  (segue/sched/interception/).
Besides: the per-request timings (first scheduled, first token, finished) and logprobs, as
vLLM's OutputProcessor does; what an output reads is RequestState.make_output's.
"""
from __future__ import annotations

from typing import Any

from segue.engine.detokenizer import IncrementalDetokenizer
from segue.engine.request_lifecycle import EngineRequests
from segue.engine.request_text import RequestState
from segue.outputs import RequestOutput, TokenLogprob
from segue.sched.output import SchedulerOutput
from segue.sched.request_update import Outcome, RequestUpdate


class OutputProcessor:
    """Not thread-safe: the engine thread calls it within a step."""

    def __init__(self, requests: EngineRequests) -> None:
        self.requests = requests

    def on_scheduled(self, out: SchedulerOutput, now: float) -> None:
        """The timings a scheduled step sets: first scheduled, preemptions so far."""
        for req in out.preempted:
            if req.request_id in self.requests:
                self.requests.state(req.request_id).metrics.num_preemptions = req.num_preemptions
        for seq in out.seqs:
            metrics = self.requests.state(seq.request.request_id).metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now

    def process(self, updates: list[RequestUpdate], sampled: dict[str, Any], now: float) -> list[RequestOutput]:
        """The outputs of the requests that got a token (`sampled`: the executor's samples)."""
        return [self._process(update, sampled, now) for update in updates]

    def _process(self, update: RequestUpdate, sampled: dict[str, Any], now: float) -> RequestOutput:
        req = update.request
        state = self.requests.state(req.request_id)
        token = req.output_token_ids[-1]
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        stop_str = state.detokenizer.append(token)
        if state.logprobs is not None:
            state.logprobs.append(token_logprob(state.detokenizer, token, sampled[req.request_id]))
        if update.outcome is Outcome.RUNNING and stop_str is not None:
            update = self._stop_at_string(state, stop_str)
        elif update.outcome is Outcome.RUNNING:
            self._pause_at_tool_call(state, now)
        if update.outcome is Outcome.FINISHED:
            self.requests.retire(req.request_id, now)
        elif update.outcome is Outcome.TURN_END:
            state.turn_end = update.finish_reason
        return state.make_output()

    def _stop_at_string(self, state: RequestState, stop_str: str) -> RequestUpdate:
        """A stop string ends the turn: the request finishes, or pauses with pause_on_stop."""
        req = state.request
        req.stop_reason = stop_str
        if req.sampling_params.pause_on_stop:
            self.requests.intercept(req.request_id, turn_end=True)
            return RequestUpdate(req, Outcome.TURN_END, "stop")
        self.requests.stop(req.request_id)
        return RequestUpdate(req, Outcome.FINISHED, "stop")

    def _pause_at_tool_call(self, state: RequestState, now: float) -> None:
        """Pause at a complete tool call in the output: the caller runs the tool and resumes. A
        driver's hooks may pause the request first (then its output is not looked at)."""
        req, hooks = state.request, self.requests.hooks
        if hooks is not None and hooks.after_token(req.request_id, req.num_generated_tokens, now):
            return
        if state.tool_parser is not None and state.tool_parser.has_complete_call(state.detokenizer.text):
            _, state.tool_calls = state.tool_parser.find_calls(state.detokenizer.text)
            self.requests.intercept(req.request_id, state.tool_calls[0].name or None, state.expected_tool_s)


def token_logprob(detok: IncrementalDetokenizer, token: int, sample: Any) -> TokenLogprob:
    """The sampled token's logprob and its top alternatives', with their texts."""
    return TokenLogprob(token, detok.token_text(token), sample.logprob or 0.0,
                        [(t, detok.token_text(t), lp) for t, lp in (sample.top or [])])
