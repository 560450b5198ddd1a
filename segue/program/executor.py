"""Runs programs' calls on an engine as soon as their inputs exist (Parrot §5.1): no client round
trip between dependent calls.

The engine is an EngineClient (segue/engine/protocol.py): one AsyncLLMEngine or a pool of them. Each call:
waits for its inputs, takes the objective deduced from the program's DAG at that moment (its
priority is fixed once it reaches the engine), renders its template segment by segment, waits if a
call with the same prompt prefix is still prefilling (then the prefix cache serves the shared part
instead of several calls computing it at once), generates, transforms the text and sets its output
variable. Any failure becomes the output variable's error, and the same error reaches every
variable downstream.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

from segue.engine.engine_request import EngineRequest, RequestHints
from segue.engine.protocol import EngineClient, EngineDeadError
from segue.outputs import RequestOutput
from segue.program.graph import CallObjective, CycleError
from segue.program.registry import ProgramLimits, ProgramRegistry, scoped_program_id
from segue.program.state import Call, CallSpec, CallState, ConflictError, Program, ProgramError
from segue.program.template import prefix_hashes
from segue.program.transforms import TransformError, apply_all
from segue.program.variables import Criteria, SemanticVariable, VariableError
from segue.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS_CAP = 1024


class CallError(RuntimeError):
    """A call failed for a reason the client may read."""


@dataclass
class ExecutorStats:
    calls_launched: int = 0
    calls_failed: int = 0
    # Calls that waited for another call's prefill of their shared prefix.
    prefix_waits: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0


class ProgramExecutor:
    def __init__(self, engine: EngineClient, encode: Callable[[str], list[int]] | None = None,
                 max_model_len: int | None = None, limits: ProgramLimits | None = None,
                 share_prefix: bool = True, min_shared_tokens: int = 64,
                 call_timeout_s: float = 600.0) -> None:
        self.engine = engine
        self.encode = encode
        self.max_model_len = max_model_len
        self.share_prefix = share_prefix
        self.min_shared_tokens = min_shared_tokens
        self.call_timeout_s = call_timeout_s
        self.registry = ProgramRegistry(limits, on_drop=self._cancel_program)
        self.stats = ExecutorStats()
        # Prefix hash -> set once the call computing that prefix has finished its prefill.
        self._prefilling: dict[int, asyncio.Event] = {}

    # ---- programs and variables ----------------------------------------------------------
    def create_program(self, owner: str | None, hints: RequestHints | None = None) -> Program:
        return self.registry.create(owner, hints)

    def delete_program(self, owner: str | None, program_id: str) -> Program:
        """Cancel the program's calls (aborting their engine requests), forget its variables and
        its replica binding."""
        program = self.registry.delete(owner, program_id)
        self.engine.forget_program(scoped_program_id(program.owner, program.id))
        return program

    def create_variable(self, owner: str | None, program_id: str, name: str,
                        value: str | None = None) -> SemanticVariable:
        program = self.registry.program(owner, program_id)
        var = SemanticVariable(owner, program.id, name)
        self.registry.add_variable(program, var)
        if value is not None:
            var.set(value)
        return var

    def set_variable(self, owner: str | None, var_id: str, value: str) -> SemanticVariable:
        _, var = self.registry.variable(owner, var_id)
        if var.producer is not None:
            raise ConflictError(f"variable {var.name!r} is the output of call {var.producer!r}; it cannot be set")
        if var.is_done:
            raise ConflictError(f"variable {var.name!r} already has a value")
        var.set(value)
        return var

    def mark(self, owner: str | None, var_id: str, criteria: Criteria) -> SemanticVariable:
        """Record what the client optimizes for this variable; calls not yet launched use it, and
        launched ones learn whether they now serve throughput."""
        program, var = self.registry.variable(owner, var_id)
        var.mark(criteria)
        program.graph.set_criteria(var.id, var.criteria or criteria)
        self._refresh_objectives(program)
        return var

    def _refresh_objectives(self, program: Program) -> None:
        """A map call reaches the engine as soon as its chunk is there, before the client has
        submitted the reduce that makes the maps a throughput task group; tell the engine (or the
        pool, which forwards it) when a launched call's objective changes, so its latency capacity
        stops holding the group back. An engine without the hook keeps the launch objective."""
        update = getattr(self.engine, "set_latency_sensitive", None)
        if update is None:
            return
        deduced = program.graph.deduce()
        for call in program.calls.values():
            objective = deduced.get(call.id)
            # Launched: its objective was taken when its inputs were ready (it may still be rendering).
            launched = "ready" in call.times and call.state in (CallState.WAITING, CallState.RUNNING)
            if not launched or objective is None:
                continue
            criteria = objective.criteria.value if objective.criteria else None
            throughput = Criteria.THROUGHPUT.value
            if (criteria == throughput) != (call.criteria == throughput):
                call.criteria, call.task_group = criteria, objective.task_group
                update(call.id, criteria != throughput)

    # ---- calls ---------------------------------------------------------------------------
    def submit(self, owner: str | None, program_id: str, spec: CallSpec,
               criteria: Criteria | None = None) -> Call:
        program = self.registry.program(owner, program_id)
        self.registry.check_call_limit(program)
        names = spec.template.input_names
        given = [*spec.inputs, *spec.literals]
        missing = [n for n in names if n not in given]
        extra = [n for n in given if n not in names]
        if missing or extra or len(set(given)) != len(given):
            raise ProgramError(f"inputs must name each input placeholder once: missing {missing}, "
                               f"not in the template {extra}")
        inputs = {n: program.variable_by_id(spec.inputs[n]) for n in names if n in spec.inputs}
        if spec.output_id is not None:
            output = program.variable_by_id(spec.output_id)
            if output.producer is not None or output.is_done:
                raise ConflictError(f"variable {output.name!r} already has a value or a producer")
            try:
                program.graph.check_call([v.id for v in inputs.values()], output.id)
            except CycleError as e:
                raise ProgramError(str(e)) from None
        # Checked before anything is added, so a refused call leaves no stray variables behind.
        self.registry.check_variable_room(program, len(spec.literals) + (spec.output_id is None))
        if spec.output_id is None:
            output = SemanticVariable(owner, program.id, spec.template.output_name)
            self.registry.add_variable(program, output)
        for name in names:
            if name in spec.literals:
                inputs[name] = SemanticVariable(owner, program.id, name)
                self.registry.add_variable(program, inputs[name])
                inputs[name].set(spec.literals[name])
        call = Call(program.id, spec, {n: inputs[n] for n in names}, output)
        program.graph.add_call(call.id, [v.id for v in inputs.values()], output.id)
        output.producer = call.id
        for var in inputs.values():
            var.consumers.append(call.id)
        program.calls[call.id] = call
        if criteria is not None:
            self.mark(owner, output.id, criteria)
        else:
            self._refresh_objectives(program)
        call.task = asyncio.get_running_loop().create_task(self._run(program, call), name=call.id)
        return call

    async def _run(self, program: Program, call: Call) -> None:
        try:
            values: dict[str, str] = {}
            for name, var in call.inputs.items():
                await var.wait()
                if var.error is not None:
                    raise var.error
                assert var.value is not None
                values[name] = var.value
            call.times["ready"] = time.monotonic()
            objective = program.graph.deduce().get(call.id, CallObjective())
            call.priority, call.task_group = objective.priority, objective.task_group
            call.criteria = objective.criteria.value if objective.criteria else None
            async with asyncio.timeout(self.call_timeout_s):  # not wait_for: see server.limits.Deadline
                text = await self._generate(program, call, values)
            call.output.set(apply_all(call.spec.transforms, text))
            call.state = CallState.DONE
            call.times["done"] = time.monotonic()
        except VariableError as e:  # an input failed: pass the first failure on unchanged
            call.state = CallState.FAILED
            call.output.fail(e)
        except asyncio.CancelledError:
            call.state = CallState.FAILED
            call.output.fail(VariableError(f"call {call.id} was cancelled (its program was deleted or "
                                           "the server is shutting down)", step=call.id))
            raise
        except Exception as e:
            call.state = CallState.FAILED
            self.stats.calls_failed += 1
            call.output.fail(VariableError(f"call {call.id} (writing {call.output.name!r}) failed: "
                                           f"{_describe(e, self.call_timeout_s)}", step=call.id))

    async def _generate(self, program: Program, call: Call, values: dict[str, str]) -> str:
        prompt, boundaries = await self._render(call, values)
        params = call.spec.params
        if call.spec.default_max_tokens:
            room = (self.max_model_len or DEFAULT_MAX_TOKENS_CAP + len(prompt)) - len(prompt)
            params = dataclasses.replace(params, max_tokens=max(1, min(room, DEFAULT_MAX_TOKENS_CAP)))
        call.state = CallState.RUNNING
        hashes = prefix_hashes(prompt, boundaries, program.hints.cache_salt,
                               self.min_shared_tokens) if self.share_prefix else []
        released = asyncio.Event()
        mine = await self._claim_prefixes(hashes, len(prompt), released)
        self.stats.calls_launched += 1
        call.times["launched"] = time.monotonic()
        try:
            final: RequestOutput | None = None
            # The deduced task group goes with the call: a pool places a group's calls side by side
            # (Parrot's task groups); one engine ignores it.
            hints = dataclasses.replace(program.hints, priority=call.priority or 0,
                                        program_id=scoped_program_id(program.owner, program.id),
                                        latency_sensitive=call.criteria != Criteria.THROUGHPUT.value,
                                        task_group=call.task_group)
            async for out in self.engine.generate(EngineRequest(prompt, params, call.id, hints=hints)):
                released.set()  # the first output comes after the prompt's KV is computed and cached
                final = out
        finally:
            released.set()
            for h in mine:
                if self._prefilling.get(h) is released:
                    del self._prefilling[h]
        if final is None or not final.finished:
            raise CallError("the engine ended the request without a final output")
        completion = final.outputs[0]
        if completion.finish_reason == "abort":
            raise CallError("the engine aborted the request")
        call.prompt_tokens, call.cached_tokens = len(final.prompt_token_ids), final.num_cached_tokens
        self.stats.prompt_tokens += call.prompt_tokens
        self.stats.cached_prompt_tokens += call.cached_tokens
        return completion.text

    async def _render(self, call: Call, values: dict[str, str]) -> tuple[str | list[int], list[int]]:
        template = call.spec.template
        if self.encode is None:
            ends, pos = [], 0
            for s in template.segments:
                pos += len(values[s.input_name] if s.input_name is not None else s.text)
                ends.append(pos)
            return template.render_text(values), ends
        encode = self.encode
        # Tokenizers are slow enough to stall every other call and stream on the event loop.
        return await asyncio.get_running_loop().run_in_executor(None, template.render_tokens, values, encode)

    async def _claim_prefixes(self, hashes: list[tuple[int, int]], prompt_len: int,
                              released: asyncio.Event) -> list[int]:
        """Wait while another call prefills our longest shared prefix, then announce the prefixes
        nobody is computing yet as ours until our own prefill is done.

        Waiting costs the leader's whole prefill and saves the shared part of ours, so it is only
        worth it when the shared part is most of our prompt."""
        for length, h in reversed(hashes):
            leader = self._prefilling.get(h)
            if leader is not None and 2 * length >= prompt_len:
                self.stats.prefix_waits += 1
                await leader.wait()
                break
        mine = [h for _, h in hashes if h not in self._prefilling]
        for h in mine:
            self._prefilling[h] = released
        return mine

    # ---- lifecycle -----------------------------------------------------------------------
    def _cancel_program(self, program: Program) -> None:
        for call in program.calls.values():
            if call.task is not None and not call.task.done():
                call.task.cancel()
        for var in program.variables.values():
            var.fail(VariableError(f"program {program.id} was deleted before {var.name!r} was produced"))

    async def aclose(self) -> None:
        tasks = [c.task for p in self.registry.programs.values() for c in p.calls.values()
                 if c.task is not None and not c.task.done()]
        self.registry.drop_all()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _describe(e: BaseException, timeout_s: float) -> str:
    """What the client may read about a failure: our own messages, never internals."""
    if isinstance(e, (InvalidRequestError, TransformError, ProgramError, CallError)):
        return str(e)
    if isinstance(e, asyncio.TimeoutError):
        return f"generation took longer than {timeout_s:g} s"
    if isinstance(e, EngineDeadError):
        return "the engine is not running"
    logger.error("program call failed unexpectedly", exc_info=e)
    return f"internal error ({type(e).__name__})"
