"""LLMEngine: the synchronous engine, built from its config; the step loop.

One step (step()) is five phases: what hooks have due (a driver's resumes), schedule, execute,
let the scheduler take the sampled tokens, and turn each new token into an output (detokenize,
logprobs, stop strings, pauses). What callers do to requests between steps (add, intercept,
resume, abort, hints) is EngineRequests' (engine/requests.py), which LLMEngine extends; making a
request from a prompt, safe from any thread, is RequestFactory's (engine/request_factory.py).
Trace replay and oracle predictions are not here: the simulator plugs them in as StepHooks
(engine/hooks.py) and drives the engine through its public methods.
"""
from __future__ import annotations

import logging
from typing import Any

from segue.config import EngineConfig
from segue.engine.engine_request import EngineRequest
from segue.engine.generation_defaults import generation_defaults
from segue.engine.input_processor import InputProcessor
from segue.engine.model_info import ModelInfo
from segue.engine.output_processor import make_output, token_logprob
from segue.engine.reports import engine_stats, load_report
from segue.engine.request_factory import RequestFactory
from segue.engine.request_state import RequestState
from segue.engine.requests import EngineRequests
from segue.engine.scheduler_builder import build_scheduler
from segue.engine.stats import EngineStats, LoadReport
from segue.executor.base import Executor
from segue.executor.loading import engine_cost_model, load_model
from segue.outputs import RequestOutput
from segue.predict import OnlinePredictors
from segue.request import Request, RequestStatus
from segue.sampling_params import SamplingParams
from segue.sched.output import SchedulerOutput
from segue.sched.step_charge import step_seconds
from segue.sched.waste import WasteMeter
from segue.tools.stats import DurationStats

logger = logging.getLogger(__name__)


class LLMEngine(EngineRequests):
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
        max_model_len = min(config.scheduler.max_model_len or model_config.max_position_embeddings,
                            model_config.max_position_embeddings, pool_tokens)
        self.cost_model = engine_cost_model(config, executor)
        tool_stats = DurationStats()
        predictors = OnlinePredictors(config.predictor, tool_stats, executor)
        scheduler = build_scheduler(config, executor, max_model_len, self.cost_model, tool_stats)
        self.waste = WasteMeter(self.cost_model.kv_bytes_per_token, executor.block_size)
        # Sampling settings the model recommends, for callers (the server) whose clients name none.
        self.generation_defaults = generation_defaults(config.model.model, config.model.generation_config)
        self.num_steps = 0
        self.step_seconds = 0.0            # executor time of all steps, and the cost model's
        self.modelled_step_seconds = 0.0   # charge for them (EngineStats)
        self.last_step_idle = True
        self.info = ModelInfo(self.model_name, max_model_len, model_config.vocab_size, chat_template,
                              tokenizer, dict(self.generation_defaults))
        self.inputs = InputProcessor(self.info)
        factory = RequestFactory(self.inputs, tokenizer, model_config, max_model_len)
        super().__init__(factory, scheduler, predictors, tool_stats, max_model_len)

    # ---- the model and making requests (safe from any thread) ----------------------------
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
        """The constrained-decoding backend, created on first use (RequestFactory.grammars)."""
        return self.factory.grammars

    def compile_grammar(self, params: SamplingParams | None) -> Any:
        """The compiled constraint of `params` (None if it has none). Callers compile before
        handing a resume to the engine thread (a cold compile would stall every request there)."""
        return self.factory.compile_grammar(params)

    def make_request(self, request: EngineRequest) -> RequestState:
        """Validate and tokenize without touching engine state (RequestFactory, safe from any
        thread); add_prepared() takes the result on the engine thread."""
        return self.factory.make_request(request)

    # ---- what callers may read of the engine ---------------------------------------------
    def stats(self) -> EngineStats:
        return engine_stats(self.scheduler, self.waste, self.num_steps, self.tool_stats, self.predictors,
                            (self.step_seconds, self.modelled_step_seconds))

    def load_report(self) -> LoadReport:
        return load_report(self.scheduler)

    def num_held_blocks(self) -> int:
        """KV blocks held by requests (running, waiting with blocks, paused): 0 once all are gone."""
        return self.scheduler.num_held_blocks()

    def next_timer(self) -> float | None:
        """When the hooks next act on their own, e.g. a scripted pause ends (an idle loop may
        sleep until then)."""
        return self.hooks.next_event() if self.hooks is not None else None

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
        self.step_seconds += step_s
        self.modelled_step_seconds += step_seconds(self.scheduler.cost, out, self.scheduler.kv.block_size)[0]
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
            self.intercept(req.request_id, turn_end=True)
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
        running_blocks = self.scheduler.num_device_blocks_of(s.request for s in out.seqs)
        self.waste.record_step(step_s, self.scheduler.paused.held_device_blocks(), running_blocks,
                               self.scheduler.last_step_recompute_tokens, out.num_batched_tokens,
                               getattr(self.executor, "last_swap_seconds", 0.0))
