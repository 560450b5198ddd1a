"""The step loop: schedule -> execute -> update, with detokenization, stop strings and tool calls.

One step (step()) is five phases: what hooks have due (a driver's resumes), schedule, execute,
let the scheduler take the sampled tokens, and turn each new token into an output (detokenize,
logprobs, stop strings, pauses). Trace replay and oracle predictions are not here: the simulator
plugs them in as StepHooks (engine_hooks.py) and drives the engine through its public methods.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from segue.config import EngineConfig
from segue.detokenizer import IncrementalDetokenizer
from segue.engine_hooks import StepHooks
from segue.engine_outputs import make_output, token_logprob
from segue.engine_reports import engine_stats, load_report
from segue.engine_scheduler import build_scheduler
from segue.engine_stats import EngineStats, LoadReport
from segue.executor.base import Executor
from segue.executor.loading import engine_cost_model, load_model
from segue.generation_defaults import generation_defaults
from segue.input_processor import InputProcessor
from segue.model_info import ModelInfo
from segue.outputs import RequestMetrics, RequestOutput
from segue.predict import OnlinePredictors
from segue.request import Request, RequestStatus
from segue.request_state import RequestState
from segue.sampling_params import InvalidRequestError, SamplingParams
from segue.sched.output import SchedulerOutput
from segue.sched.waste import WasteMeter
from segue.tools.stats import DurationStats

logger = logging.getLogger(__name__)


class LLMEngine:
    """Synchronous engine. Not thread-safe: AsyncLLMEngine owns one and drives it from a thread."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None,
                 tokenizer: Any = None, model_config: Any = None, model_name: str | None = None,
                 chat_template: str | None = None) -> None:
        config.validate()
        self.config = config
        if executor is None:
            executor, tokenizer, model_config, model_name, chat_template = load_model(config)
        self.executor = executor
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.chat_template = chat_template
        self.model_name = config.model.served_model_name or model_name or "segue-model"
        pool_tokens = executor.num_device_blocks * executor.block_size
        self.max_model_len = min(config.scheduler.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings, pool_tokens)
        self.cost_model = engine_cost_model(config, executor)
        self.tool_stats = DurationStats()
        self.predictors = OnlinePredictors(config.predictor, self.tool_stats, executor)
        self.scheduler = build_scheduler(config, executor, self.max_model_len, self.cost_model, self.tool_stats)
        self.waste = WasteMeter(self.cost_model.kv_bytes_per_token, executor.block_size)
        # A driver's part in the loop (the simulator's trace replay); None when serving.
        self.hooks: StepHooks | None = None
        self.clock = time.monotonic
        self._states: dict[str, RequestState] = {}
        self._grammars: Any = None
        # make_request runs on worker threads: two first constrained requests must share one backend.
        self._grammars_lock = threading.Lock()
        # Sampling settings the model recommends, for callers (the server) whose clients name none.
        self.generation_defaults = generation_defaults(config.model.model, config.model.generation_config)
        self.num_steps = 0
        self.last_step_idle = True
        self.info = ModelInfo(self.model_name, self.max_model_len, model_config.vocab_size, chat_template,
                              tokenizer, dict(self.generation_defaults))
        self.inputs = InputProcessor(self.info)

    # ---- the model (safe from any thread) ------------------------------------------------
    def model_info(self) -> ModelInfo:
        return self.info

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        return self.inputs.apply_chat_template(messages, add_generation_prompt, tools)

    def encode(self, prompt: str) -> list[int]:
        return self.inputs.encode(prompt)

    def decode(self, token_ids: list[int]) -> str:
        return self.inputs.decode(token_ids)

    @property
    def grammars(self) -> Any:
        """The constrained-decoding backend (segue.structured.backend), created on first use so
        engines that never see a constrained request never import the grammar library."""
        with self._grammars_lock:
            if self._grammars is None:
                from segue.structured.backend import GrammarBackend
                # Every end-of-turn token the generation config names may end a constrained answer.
                eos = self.model_config.eos_token_ids or (self.tokenizer.eos_token_id,)
                self._grammars = GrammarBackend(self.tokenizer, self.model_config.vocab_size, eos)
            return self._grammars

    def compile_grammar(self, params: SamplingParams | None) -> Any:
        """The compiled constraint of `params` (None if it has none). Safe from any thread: callers
        compile before handing a resume to the engine thread (a cold compile would stall every
        request there)."""
        if params is None or params.structured is None:
            return None
        return self.grammars.compile(params.structured)

    # ---- requests ------------------------------------------------------------------------
    def make_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                     arrival_time: float | None = None, priority: int = 0,
                     program_id: str | None = None, tool_parser: Any = None,
                     cache_salt: str | None = None, expected_tool_s: float | None = None,
                     latency_sensitive: bool = True) -> RequestState:
        """Validate and tokenize without touching engine state (safe from any thread)."""
        text, token_ids = self.inputs.process(prompt, params)
        request_id = request_id or uuid.uuid4().hex
        now = time.monotonic() if arrival_time is None else arrival_time
        request = Request(request_id, token_ids, params, now, self.model_config.eos_token_ids,
                          priority=priority, program_id=program_id, cache_salt=cache_salt,
                          latency_sensitive=latency_sensitive)
        if params.structured is not None:
            request.grammar = self.grammars.matcher(params.structured, start=0,
                                                    output_limit=self.max_model_len - len(token_ids))
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, params)
        return RequestState(request, text, detok, RequestMetrics(arrival_time=now),
                            [] if params.logprobs is not None else None, tool_parser=tool_parser,
                            expected_tool_s=expected_tool_s)

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

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    program_id: str | None = None, tool_parser: Any = None) -> Request:
        state = self.make_request(request_id, prompt, params, arrival_time, priority, program_id, tool_parser)
        return self.add_prepared(state)

    # ---- interceptions -------------------------------------------------------------------
    def intercept(self, request_id: str, tool: str | None = None, expected_s: float | None = None) -> None:
        """Pause a request that just produced a token (a tool call, a human turn). Its KV then
        follows the interception policy until resume()."""
        req = self._states[request_id].request
        self.predictors.on_intercept(req, tool, expected_s)
        self._predicted(req)
        if expected_s is None and tool is not None:
            expected_s = self.tool_stats.expected(tool)
        self.scheduler.intercept_request(req, self.clock(), tool, expected_s)

    def resume(self, request_id: str, tokens: list[int], params: SamplingParams | None = None,
               compiled: Any = None) -> None:
        """End a request's interception; `tokens` (the tool result, a user turn) join its context.
        `params` replaces the sampling settings (a new turn); its max_tokens counts from here.
        `compiled`: params' constraint from compile_grammar(), which callers on another thread pass
        so that nothing compiles here; without it a constraint of `params` is compiled here."""
        state = self._states.get(request_id)
        if state is None or state.request.interception is None:
            raise InvalidRequestError(f"request {request_id!r} is not paused")
        req, interception = state.request, state.request.interception
        if req.num_tokens + len(tokens) >= self.max_model_len:
            raise InvalidRequestError(f"resuming {request_id!r} would exceed the context window")
        # New params bring their own constraint; otherwise what the constraint says follows a
        # resume applies (compiled with it: nothing to compile).
        if params is not None:
            params.validate()
            if compiled is None:
                compiled = self.compile_grammar(params)
            req.sampling_params = SamplingParams(**{**params.__dict__,
                                                    "max_tokens": req.num_generated_tokens + params.max_tokens})
        previous = req.grammar
        state.tool_calls = None
        state.turn_end = None
        req.stop_reason = None
        if interception.tool is not None:
            self.tool_stats.observe(interception.tool, self.clock() - interception.t_call)
        state.text_before += state.detokenizer.flush()
        self.predictors.on_resume(req, len(tokens), self.clock())
        self._predicted(req)
        self.scheduler.resume_request(req, list(tokens), self.clock())
        # Constrains only what is generated from here on.
        start = len(req.output_token_ids)
        if params is not None:
            req.grammar = (self.grammars.matcher(compiled, start, self.max_model_len - len(req.prompt_token_ids))
                           if compiled is not None else None)
        else:
            req.grammar = previous.resumed(start) if previous is not None else None
        state.detokenizer = IncrementalDetokenizer(self.tokenizer, req.all_token_ids, req.sampling_params)

    def next_timer(self) -> float | None:
        """When the hooks next act on their own, e.g. a scripted pause ends (an idle loop may
        sleep until then)."""
        return self.hooks.next_event() if self.hooks is not None else None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        self.predictors.forget(request_id)
        self.scheduler.abort_request(request_id)
        self._ended(request_id)
        state.metrics.finished_time = time.monotonic()
        return make_output(state)

    def finish_request(self, request_id: str, status: RequestStatus, now: float) -> RequestOutput | None:
        """End a request from outside the step (a replayed script outgrew the context window)."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.finish_request(state.request, status)
        state.metrics.finished_time = now
        self._ended(request_id)
        self.predictors.forget(request_id)
        return make_output(state)

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

    def set_tool_parser(self, request_id: str, parser: Any) -> None:
        """The caller re-armed its tool-call parser between turns (a copy of it lives here)."""
        state = self._states.get(request_id)
        if state is not None:
            state.tool_parser = parser

    # ---- what callers may read -----------------------------------------------------------
    def paused_token_ids(self, request_id: str) -> list[int] | None:
        """The token ids a paused request holds (what a continuation extends); None if it is not
        paused."""
        state = self._states.get(request_id)
        if state is None or state.request.interception is None:
            return None
        return list(state.request.all_token_ids)

    def stats(self) -> EngineStats:
        return engine_stats(self.scheduler, self.waste, self.num_steps, self.tool_stats, self.predictors)

    def load_report(self) -> LoadReport:
        return load_report(self.scheduler)

    def num_held_blocks(self) -> int:
        """KV blocks held by requests (running, waiting with blocks, paused): 0 once all are gone."""
        return self.scheduler.kv.num_held_blocks()

    def unfinished_request_ids(self) -> list[str]:
        return list(self._states)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._states)

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        assert set(self._states) == set(self.scheduler.requests), "engine and scheduler disagree"

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        now = self.clock()
        ended = self.hooks.before_step(now) if self.hooks is not None else []
        out = self.scheduler.schedule(now)
        # A step that only preempted changed what the next one can admit: not idle (drivers that
        # wait for an event when idle would otherwise see a deadlock that is not there).
        self.last_step_idle = out.is_empty and not out.preempted and not ended
        self._count_preemptions(out)
        if out.is_empty:
            return ended
        self._mark_scheduled(out, now)
        try:
            sampled, step_s = self._execute(out)
        except Exception:
            # A failing batch must not take the engine down: fail its requests, keep serving.
            logger.exception("executor failed; aborting the %d requests in this batch", len(out.seqs))
            return [o for o in (self.abort_request(s.request.request_id) for s in out.seqs) if o]
        got_token = self._update(out, sampled, step_s)
        now = self.clock()
        return ended + [self._process_token(req, sampled, now) for req in got_token]

    def _mark_scheduled(self, out: SchedulerOutput, now: float) -> None:
        for seq in out.seqs:
            state = self._states[seq.request.request_id]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now

    def _execute(self, out: SchedulerOutput) -> tuple[dict[str, Any], float]:
        """The sampled token per request, and the seconds the executor took."""
        self.predictors.request_hidden_states(out.seqs)
        t0 = self.clock()
        sampled = self.executor.execute(out)
        return sampled, self.clock() - t0

    def _update(self, out: SchedulerOutput, sampled: dict[str, Any], step_s: float) -> list[Request]:
        """The scheduler takes the sampled tokens; the requests that got one."""
        self.num_steps += 1
        self.predictors.on_sampled(out.seqs, sampled)
        got_token = self.scheduler.update_from_output(out, {rid: s.token_id for rid, s in sampled.items()})
        self._record_waste(out, step_s)
        return got_token

    def _process_token(self, req: Request, sampled: dict[str, Any], now: float) -> RequestOutput:
        state = self._states[req.request_id]
        token = req.output_token_ids[-1]
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        stop_str = state.detokenizer.append(token)
        if state.logprobs is not None:
            state.logprobs.append(token_logprob(state.detokenizer, token, sampled[req.request_id]))
        if stop_str is not None and not req.is_finished and req.interception is None:
            self._stop_at_string(req, stop_str)
        if req.is_finished:
            self._finished(state, now)
        elif req.interception is not None:
            # Only the end of a turn pauses a request inside update_from_output (or at a stop
            # string): a stop (token or string), or max_tokens.
            status = self.scheduler.stop_status(req, token)
            state.turn_end = "length" if status is RequestStatus.FINISHED_LENGTH else "stop"
        elif not (self.hooks is not None and self.hooks.after_token(req.request_id, req.num_generated_tokens, now)):
            self._intercept_tool_call(state)
        return make_output(state)

    def _stop_at_string(self, req: Request, stop_str: str) -> None:
        req.stop_reason = stop_str
        if req.sampling_params.pause_on_stop:
            self.intercept(req.request_id)
        else:
            self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)

    def _finished(self, state: RequestState, now: float) -> None:
        state.metrics.finished_time = now
        self.predictors.on_finish(state.request)
        del self._states[state.request.request_id]
        self._ended(state.request.request_id)

    def _intercept_tool_call(self, state: RequestState) -> None:
        """Pause at a complete tool call in the output: the caller runs the tool and resumes."""
        if state.tool_parser is not None and state.tool_parser.has_complete_call(state.detokenizer.text):
            _, state.tool_calls = state.tool_parser.find_calls(state.detokenizer.text)
            self.intercept(state.request.request_id, state.tool_calls[0].name or None, state.expected_tool_s)

    def _count_preemptions(self, out: SchedulerOutput) -> None:
        for req in out.preempted:
            if req.request_id in self._states:
                self._states[req.request_id].metrics.num_preemptions = req.num_preemptions

    def _record_waste(self, out: SchedulerOutput, step_s: float) -> None:
        kv = self.scheduler.kv
        running_blocks = sum(kv.num_device_blocks_of(s.request.request_id) for s in out.seqs)
        self.waste.record_step(step_s, self.scheduler.paused.held_device_blocks(), running_blocks,
                               self.scheduler.last_step_recompute_tokens, out.num_batched_tokens,
                               getattr(self.executor, "last_swap_seconds", 0.0))

    # ---- hooks ---------------------------------------------------------------------------
    def _predicted(self, req: Request) -> None:
        if self.hooks is not None:
            self.hooks.after_prediction(req)

    def _ended(self, request_id: str) -> None:
        if self.hooks is not None:
            self.hooks.on_request_end(request_id)
