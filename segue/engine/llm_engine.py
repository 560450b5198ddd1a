"""LLMEngine: the synchronous engine, built from its config; the step loop.

One step (step()) is five phases: what hooks have due (a driver's resumes), schedule, execute,
let the scheduler take the sampled tokens and say what happened to each request, and relay that
through the output processing (engine/output_processor.py: detokenize, logprobs, stop strings,
tool-call pauses, timings), which also says who owns which decision about a token. An LLMEngine
has its requests (EngineRequests, engine/request_lifecycle.py: what callers do to requests between steps,
add, intercept, resume, abort, hints) and forwards those public methods to it; making a request
from a prompt, safe from any thread, is RequestFactory's (engine/request_factory.py). Trace
replay and oracle predictions are not here: the simulator plugs them in as StepHooks
(engine/hooks.py) and drives the engine through its public methods.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Concatenate, ParamSpec, TypeVar

from segue.config import EngineConfig
from segue.engine.engine_request import EngineRequest
from segue.engine.generation_defaults import generation_defaults
from segue.engine.hooks import StepHooks
from segue.engine.input_processor import InputProcessor
from segue.engine.memory_waste import WasteMeter
from segue.engine.model_info import ModelInfo
from segue.engine.output_processor import OutputProcessor
from segue.engine.reports import engine_stats, load_report
from segue.engine.request_factory import RequestFactory
from segue.engine.request_lifecycle import EngineRequests
from segue.engine.request_text import RequestState
from segue.engine.scheduler_builder import build_scheduler
from segue.engine.stats import EngineStats, LoadReport
from segue.executor.base import Executor
from segue.executor.loading import engine_cost_model, load_model
from segue.outputs import RequestOutput
from segue.predict.online import OnlinePredictors
from segue.sampling_params import SamplingParams
from segue.sched.output import SchedulerOutput
from segue.sched.request_update import RequestUpdate
from segue.sched.step_charge import step_seconds
from segue.tools.stats import DurationStats

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _to_requests(method: Callable[Concatenate[EngineRequests, _P], _R]) -> Callable[Concatenate[LLMEngine, _P], _R]:
    """An LLMEngine method that is its EngineRequests' `method`: same signature and docstring,
    written once (in engine/request_lifecycle.py)."""
    @functools.wraps(method)
    def forward(self: LLMEngine, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return method(self.requests, *args, **kwargs)
    return forward


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
        self.factory = RequestFactory(self.inputs, tokenizer, model_config, max_model_len)
        self.scheduler = scheduler
        self.predictors = predictors
        self.tool_stats = tool_stats
        self.max_model_len = max_model_len
        self.requests = EngineRequests(self.factory, scheduler, predictors, tool_stats, max_model_len)
        self.output = OutputProcessor(self.requests)

    # ---- what callers do to requests between steps: EngineRequests' (engine/request_lifecycle.py) --
    add_prepared = _to_requests(EngineRequests.add_prepared)
    add_request = _to_requests(EngineRequests.add_request)
    intercept = _to_requests(EngineRequests.intercept)
    resume = _to_requests(EngineRequests.resume)
    abort_request = _to_requests(EngineRequests.abort_request)
    finish_request = _to_requests(EngineRequests.finish_request)
    expect_resume = _to_requests(EngineRequests.expect_resume)
    abandon = _to_requests(EngineRequests.abandon)
    set_latency_sensitive = _to_requests(EngineRequests.set_latency_sensitive)
    paused_token_ids = _to_requests(EngineRequests.paused_token_ids)
    unfinished_request_ids = _to_requests(EngineRequests.unfinished_request_ids)
    has_unfinished_requests = _to_requests(EngineRequests.has_unfinished_requests)
    check_invariants = _to_requests(EngineRequests.check_invariants)

    @property
    def num_unfinished_requests(self) -> int:
        return self.requests.num_unfinished_requests

    @property
    def hooks(self) -> StepHooks | None:
        """A driver's part in the loop (the simulator's trace replay); None when serving."""
        return self.requests.hooks

    @hooks.setter
    def hooks(self, hooks: StepHooks | None) -> None:
        self.requests.hooks = hooks

    @property
    def clock(self) -> Callable[[], float]:
        """The engine's clock (time.monotonic; the simulator's virtual clock)."""
        return self.requests.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.requests.clock = clock

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
        return engine_stats(self.scheduler.state, self.waste, self.num_steps, self.tool_stats, self.predictors,
                            (self.step_seconds, self.modelled_step_seconds))

    def load_report(self) -> LoadReport:
        return load_report(self.scheduler.state)

    def num_held_blocks(self) -> int:
        """KV blocks held by requests (running, waiting with blocks, paused): 0 once all are gone."""
        return self.scheduler.state.num_held_blocks()

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
        self.output.on_scheduled(out, now)
        if out.is_empty:
            return ended
        try:
            sampled, step_s = self._execute(out)
        except Exception:
            # A failing batch must not take the engine down: fail its requests, keep serving. The
            # contexts its copies moved are cut back to what is known to be there (a paused
            # request's swap-out may never have reached the host), to be computed again.
            logger.exception("executor failed; aborting the %d requests in this batch", len(out.seqs))
            cut = self.scheduler.forget_failed_copies(out)
            if cut:
                logger.warning("the failed step's KV copies count as not made: %d contexts cut back "
                               "to recompute (%s)", len(cut), ", ".join(cut[:8]))
            return [o for o in (self.abort_request(s.request.request_id) for s in out.seqs) if o]
        updates = self._update(out, sampled, step_s)
        return ended + self.output.process(updates, sampled, self.clock())

    def _execute(self, out: SchedulerOutput) -> tuple[dict[str, Any], float]:
        """The sampled token per request, and the seconds the executor took."""
        self.predictors.request_hidden_states(out.seqs)
        t0 = self.clock()
        sampled = self.executor.execute(out)
        return sampled, self.clock() - t0

    def _update(self, out: SchedulerOutput, sampled: dict[str, Any], step_s: float) -> list[RequestUpdate]:
        """The scheduler takes the sampled tokens; what happened to each request that got one."""
        self.num_steps += 1
        self.step_seconds += step_s
        self.modelled_step_seconds += step_seconds(self.cost_model, out, self.executor.block_size)[0]
        self.predictors.on_sampled(out.seqs, sampled)
        updates = self.scheduler.update_from_output(out, {rid: s.token_id for rid, s in sampled.items()})
        self._record_waste(out, step_s)
        return updates

    def _record_waste(self, out: SchedulerOutput, step_s: float) -> None:
        state = self.scheduler.state
        running_blocks = state.num_device_blocks_of(s.request for s in out.seqs)
        self.waste.record_step(step_s, state.paused_device_blocks(), running_blocks,
                               state.last_step_recompute_tokens, out.num_batched_tokens,
                               getattr(self.executor, "last_swap_seconds", 0.0))
