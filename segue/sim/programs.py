"""Parrot's chain and map-reduce summaries (paper 003 §8.2) in the simulator, program-aware vs
request-centric, so the paper's regime (an A100, `--preset gptj-6b-a100`) is measurable without
a GPU. Content is token ids; the engine, scheduler and KV manager are the real ones.

- chain: call i summarizes chunk i together with call i-1's output (its generated token ids).
- map-reduce: one call per chunk, then one call over all their outputs.

Program-aware (Parrot): the whole DAG is on the server. A call is added the moment its inputs exist
(no client round trip between dependent calls), the calls share their template's instruction
prefix through the prefix cache, and objectives come from segue.program.graph's deduction (the
final output is asked for with latency criteria: map calls form a task group, throughput-preferred,
exempt from the latency capacity; chain calls are each on the critical path). The client pays one
round trip: submitting the program and getting its result.

Request-centric (the paper's baseline, vLLM behind a LangChain client): each call is its own
request that the client sends after it has the previous response (a full round trip per
dependent call; independent maps go out concurrently), every request is latency-sensitive so the
engine's latency capacity (`--latency-capacity-tokens`, Parrot's 4096 on their A100) caps the
running batch, and the engine has no prefix-sharing awareness (prefix caching off).
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from segue.engine.engine_request import EngineRequest, RequestHints
from segue.sampling_params import SamplingParams

WORKLOADS = ("chain", "map-reduce")


@dataclass(frozen=True)
class ProgramSpec:
    workload: str = "chain"
    num_chunks: int = 20
    chunk_tokens: int = 1024
    output_tokens: int = 50
    instruction_tokens: int = 64
    rtt_s: float = 0.25
    seed: int = 0


@dataclass
class _Call:
    name: str
    deps: list[str]
    # Token ids before the inputs (the template's instruction), and the call's own text (a chunk).
    instruction: list[int]
    own: list[int]
    latency_sensitive: bool = True
    priority: int = 0
    added_at: float | None = None
    finished_at: float | None = None
    output: list[int] = field(default_factory=list)


def _calls(spec: ProgramSpec, vocab: tuple[int, int]) -> list[_Call]:
    rng = np.random.default_rng([spec.seed, 3])
    lo, hi = vocab

    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(lo, hi, size=n)]
    chunks = [ids(spec.chunk_tokens) for _ in range(spec.num_chunks)]
    if spec.workload == "chain":
        instruction = ids(spec.instruction_tokens)
        return [_Call(f"c{i}", [f"c{i - 1}"] if i else [], instruction, chunk) for i, chunk in enumerate(chunks)]
    if spec.workload == "map-reduce":
        instruction, combine = ids(spec.instruction_tokens), ids(spec.instruction_tokens)
        maps = [_Call(f"m{i}", [], instruction, chunk) for i, chunk in enumerate(chunks)]
        return maps + [_Call("reduce", [m.name for m in maps], combine, [])]
    raise ValueError(f"workload must be one of {WORKLOADS}")


def _deduce(calls: list[_Call]) -> None:
    """Parrot's objective deduction (segue.program.graph) with the final output asked for latency."""
    from segue.program.graph import ProgramGraph
    from segue.program.variables import Criteria

    g = ProgramGraph()
    for c in calls:
        g.add_variable(f"out:{c.name}")
    for c in calls:
        g.add_call(c.name, [f"out:{d}" for d in c.deps], f"out:{c.name}")
    g.set_criteria(f"out:{calls[-1].name}", Criteria.LATENCY)
    objectives = g.deduce()
    for c in calls:
        obj = objectives[c.name]
        c.latency_sensitive = obj.criteria is not Criteria.THROUGHPUT
        c.priority = obj.priority


def run_program(engine: Any, spec: ProgramSpec, program_aware: bool, clock_wait: Callable[[float], None],
                check_invariants: bool = False) -> dict[str, Any]:
    """End-to-end seconds of one program (the client's view: from sending to having the result)."""
    from segue.sim.replay import token_range

    calls = _calls(spec, token_range(engine.model_config.vocab_size))
    by_name = {c.name: c for c in calls}
    if program_aware:
        _deduce(calls)
    # Program: one submission (half a round trip in), calls start as their inputs exist, the
    # result goes back (half a round trip out). Baseline: every call's request takes half a round
    # trip to arrive and its response half a round trip to come back before anything depends on it.
    hop = spec.rtt_s / 2
    start = engine.clock()
    params = SamplingParams(temperature=0, max_tokens=spec.output_tokens, ignore_eos=True)
    due: list[tuple[float, int, str]] = []
    seq = 0

    def ready(call: _Call, inputs_at: float) -> None:
        nonlocal seq
        delay = 0.0 if program_aware else 2 * hop
        seq += 1
        heapq.heappush(due, (inputs_at + delay, seq, call.name))

    for c in calls:
        if not c.deps:
            seq += 1
            heapq.heappush(due, (start + hop, seq, c.name))
    waiting = {c.name: set(c.deps) for c in calls if c.deps}
    done = 0
    while done < len(calls):
        now = engine.clock()
        while due and due[0][0] <= now:
            at, _, name = heapq.heappop(due)
            c = by_name[name]
            prompt = c.instruction + [t for d in c.deps for t in by_name[d].output] + c.own
            hints = RequestHints(priority=c.priority, program_id="p" if program_aware else None,
                                 latency_sensitive=c.latency_sensitive)
            state = engine.make_request(EngineRequest(prompt, params, name, hints=hints, arrival_time=at))
            engine.add_prepared(state)
            c.added_at = at
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    c = by_name[out.request_id]
                    c.finished_at, c.output = engine.clock(), list(out.outputs[0].token_ids)
                    done += 1
                    for other, deps in waiting.items():
                        if c.name in deps:
                            deps.discard(c.name)
                            if not deps:
                                ready(by_name[other], c.finished_at)
            if check_invariants:
                engine.check_invariants()
            if not engine.last_step_idle:
                continue
        if not due:
            raise RuntimeError("program stalled: calls left but nothing runs or is due")
        clock_wait(due[0][0])
    end = max(c.finished_at or 0.0 for c in calls) + hop
    return {"e2e_s": end - start, "calls": len(calls), "preemptions": engine.scheduler.state.num_preemptions_total,
            "prefix_hit_tokens": engine.scheduler.state.prefix_hit_tokens,
            "prefix_query_tokens": engine.scheduler.state.prefix_query_tokens, "steps": engine.num_steps}
