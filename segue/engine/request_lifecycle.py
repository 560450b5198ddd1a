"""The requests an engine holds, and what its callers do to them between steps.

EngineRequests keeps each request's RequestState beside the scheduler's Request and carries out
a request's life: it is added, paused (intercept: a tool call, a human turn), resumed with new
tokens, stopped, aborted or ended; callers pass hints about paused requests and read them.
LLMEngine (engine/llm_engine.py) has one and forwards its public methods to it; the step's output
processing (engine/output_processor.py) decides at stop strings and tool calls and has the
decision carried out here. Requests are made off the engine thread by RequestFactory
(engine/request_factory.py). This is the one place that tells the predictors of a request's
arrival, pause (intercept; the scheduler's own pause at the end of a turn is learnt at resume),
resume and end, and the one place that calls the scheduler to pause, resume, stop or abort a
request; a driver's StepHooks (engine/hooks.py) hear of every prediction and end.
"""
from __future__ import annotations

import time
from typing import Any

from segue.engine.detokenizer import IncrementalDetokenizer
from segue.engine.engine_request import EngineRequest
from segue.engine.hooks import StepHooks
from segue.engine.request_factory import RequestFactory
from segue.engine.request_text import RequestState
from segue.outputs import RequestOutput
from segue.predict.online import OnlinePredictors
from segue.request import Request, RequestStatus
from segue.sampling_params import InvalidRequestError, SamplingParams
from segue.sched.scheduler import Scheduler
from segue.tools.stats import DurationStats


class EngineRequests:
    """Not thread-safe: called on the engine thread, between steps."""

    def __init__(self, factory: RequestFactory, scheduler: Scheduler, predictors: OnlinePredictors,
                 tool_stats: DurationStats, max_model_len: int) -> None:
        self.factory = factory
        self.scheduler = scheduler
        self.predictors = predictors
        self.tool_stats = tool_stats
        self.max_model_len = max_model_len
        # A driver's part in the loop (the simulator's trace replay); None when serving.
        self.hooks: StepHooks | None = None
        self.clock = time.monotonic
        self._states: dict[str, RequestState] = {}

    # ---- requests ------------------------------------------------------------------------
    def add_prepared(self, state: RequestState) -> Request:
        rid = state.request.request_id
        if rid in self._states:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        self._states[rid] = state
        # Predict before the scheduler's policy sees the request: its arrival hook may read them.
        self.predictors.on_arrival(state.request, state.expected_tool_s)
        self._predicted(state.request)
        self.scheduler.add_request(state.request)
        return state.request

    def add_request(self, request: EngineRequest) -> Request:
        """make_request and add_prepared in one (callers on the engine's own thread)."""
        return self.add_prepared(self.factory.make_request(request))

    # ---- interceptions -------------------------------------------------------------------
    def intercept(self, request_id: str, tool: str | None = None, expected_s: float | None = None,
                  turn_end: bool = False) -> None:
        """Pause a request that just produced a token (a tool call, a human turn). Its KV then
        follows the interception policy until resume()."""
        req = self._states[request_id].request
        self.predictors.on_intercept(req, tool, expected_s)
        self._predicted(req)
        if expected_s is None and tool is not None:
            expected_s = self.tool_stats.expected(tool)
        self.scheduler.intercept_request(req, self.clock(), tool, expected_s, turn_end)

    def resume(self, request_id: str, tokens: list[int], params: SamplingParams | None = None,
               compiled: Any = None, keep: int | None = None) -> None:
        """End a request's interception; `tokens` (the tool result, a user turn) join its context.
        `params` replaces the sampling settings (a new turn); its max_tokens counts from here.
        `compiled`: params' constraint from compile_grammar(), which callers on another thread pass
        so that nothing compiles here; without it a constraint of `params` is compiled here.
        `keep`: the context is first cut after its first `keep` tokens (at least the prompt), so
        `tokens` replace the rest (a session turn whose history renders differently)."""
        state = self._states.get(request_id)
        if state is None or state.request.interception is None:
            raise InvalidRequestError(f"request {request_id!r} is not paused")
        req, interception = state.request, state.request.interception
        if keep is not None and not req.num_prompt_tokens <= keep <= req.num_tokens:
            raise InvalidRequestError(f"request {request_id!r} can keep {req.num_prompt_tokens} to "
                                      f"{req.num_tokens} tokens of its context, not {keep}")
        if (req.num_tokens if keep is None else keep) + len(tokens) >= self.max_model_len:
            raise InvalidRequestError(f"resuming {request_id!r} would exceed the context window")
        # New params bring their own constraint; otherwise what the constraint says follows a
        # resume applies (compiled with it: nothing to compile).
        if params is not None:
            params.validate()
            if compiled is None:
                compiled = self.factory.compile_grammar(params)
            req.sampling_params = SamplingParams(**{**params.__dict__,
                                                    "max_tokens": req.num_generated_tokens + params.max_tokens})
        previous = req.grammar
        state.tool_calls = None
        state.turn_end = None
        req.stop_reason = None
        if interception.tool is not None:
            self.tool_stats.observe(interception.tool, self.clock() - interception.t_call)
        state.text_before += state.detokenizer.flush()
        if keep is not None and keep < req.num_tokens:
            self.scheduler.truncate_paused(req, keep)
        self.predictors.on_resume(req, len(tokens), self.clock())
        self._predicted(req)
        self.scheduler.resume_request(req, list(tokens), self.clock())
        # Constrains only what is generated from here on.
        start = len(req.output_token_ids)
        if params is not None:
            req.grammar = (self.factory.grammars.matcher(compiled, start,
                                                         self.max_model_len - len(req.prompt_token_ids))
                           if compiled is not None else None)
        else:
            req.grammar = previous.resumed(start) if previous is not None else None
        state.detokenizer = IncrementalDetokenizer(self.factory.tokenizer, req.all_token_ids, req.sampling_params)

    def stop(self, request_id: str) -> None:
        """Finish a running request at a stop string the output processing found (its KV goes
        back now; retire() follows in the same step)."""
        self.scheduler.finish_request(self._states[request_id].request, RequestStatus.FINISHED_STOPPED)

    def retire(self, request_id: str, now: float) -> None:
        """A request finished in this step (by the scheduler, or at a stop string): its timings
        close, the predictors learn its true length, and it leaves the engine."""
        state = self._states.pop(request_id)
        state.metrics.finished_time = now
        self.predictors.on_finish(state.request)
        self._ended(request_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        self.predictors.forget(request_id)
        self.scheduler.abort_request(request_id)
        self._ended(request_id)
        state.metrics.finished_time = time.monotonic()
        return state.make_output()

    def finish_request(self, request_id: str, status: RequestStatus, now: float) -> RequestOutput | None:
        """End a request from outside the step (a replayed script outgrew the context window)."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.finish_request(state.request, status)
        state.metrics.finished_time = now
        self._ended(request_id)
        self.predictors.forget(request_id)
        return state.make_output()

    # ---- a caller's hints about a paused request (the server's clients) -------------------
    def expect_resume(self, request_id: str, after_s: float) -> bool:
        """A caller's estimate of a paused request's pause: continued `after_s` seconds after it
        began (math.inf: never), for the interception policy and the eviction order of its
        blocks. False if it is not paused."""
        state = self._states.get(request_id)
        it = state.request.interception if state is not None else None
        return it is not None and self.scheduler.set_expected_resume(request_id, it.t_call + after_s)

    def abandon(self, request_id: str) -> bool:
        """Nobody is expected to continue this paused request: its device memory goes back to the
        pool now, its blocks stay findable in the prefix cache (Scheduler.abandon)."""
        return self.scheduler.abandon(request_id)

    def set_latency_sensitive(self, request_id: str, latency_sensitive: bool) -> bool:
        """A program call's objective changed; False if the request is not here (yet)."""
        state = self._states.get(request_id)
        if state is not None:
            state.request.latency_sensitive = latency_sensitive
        return state is not None

    # ---- what callers may read -----------------------------------------------------------
    def state(self, request_id: str) -> RequestState:
        """The engine's side of a request it holds (KeyError if it holds none)."""
        return self._states[request_id]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def paused_token_ids(self, request_id: str) -> list[int] | None:
        """The token ids a paused request holds (what a continuation extends); None if it is not
        paused."""
        state = self._states.get(request_id)
        if state is None or state.request.interception is None:
            return None
        return list(state.request.all_token_ids)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._states)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._states)

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        assert set(self._states) == set(self.scheduler.state.requests), "engine and scheduler disagree"

    # ---- hooks ---------------------------------------------------------------------------
    def _predicted(self, req: Request) -> None:
        if self.hooks is not None:
            self.hooks.after_prediction(req)

    def _ended(self, request_id: str) -> None:
        if self.hooks is not None:
            self.hooks.on_request_end(request_id)
