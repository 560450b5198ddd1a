"""The DAG of one program: calls and the variables between them, and objective deduction.

Pure bookkeeping over ids (no asyncio, no engine), so the analysis is testable on hand-built graphs.
Producers and consumers (Parrot's GetProducer / GetConsumers) recover the dependencies; the
criteria clients attach to the variables they get (GetPerfObj) are propagated backwards (§5.2):

- a throughput-critical variable marks every call it depends on throughput-preferred;
- a latency-critical variable marks its producer latency-sensitive, and walking back from a
  latency-sensitive or grouped call, a lone producer is on the critical path (latency-sensitive),
  while two or more parallel producers of one consumer form a task group: the consumer waits for
  the slowest of them, so the group is best run for throughput (big batches), not each call fast.

Latency beats throughput when a call is reached both ways. The engine sees the result as a
priority hint in vLLM's convention: lower values are scheduled first.
"""
from __future__ import annotations

from dataclasses import dataclass

from segue.program.variables import Criteria

# vLLM convention: lower runs first. Unmarked calls share ordinary requests' default of 0.
PRIORITY = {Criteria.LATENCY: -1, None: 0, Criteria.THROUGHPUT: 1}


class CycleError(ValueError):
    pass


@dataclass(frozen=True)
class CallObjective:
    criteria: Criteria | None = None
    # Calls of one group feed the same consumer in parallel; the id names that consumer.
    task_group: str | None = None

    @property
    def priority(self) -> int:
        return PRIORITY[self.criteria]


class ProgramGraph:
    def __init__(self) -> None:
        self.inputs: dict[str, list[str]] = {}     # call -> input variables
        self.output: dict[str, str] = {}           # call -> output variable
        self.producer: dict[str, str] = {}         # variable -> the call that writes it
        self.consumers: dict[str, list[str]] = {}  # variable -> calls that read it
        self.criteria: dict[str, Criteria] = {}    # variable -> what its gets asked for

    def add_variable(self, var: str) -> None:
        self.consumers.setdefault(var, [])

    def check_call(self, inputs: list[str], output: str) -> None:
        """Raise CycleError if a call reading `inputs` and writing `output` would close a cycle,
        ValueError if `output` already has a producer."""
        if output in self.producer:
            raise ValueError("the output variable already has a producer")
        if output in inputs or output in self.upstream_variables(inputs):
            raise CycleError("the call's output is one of its own (transitive) inputs: the program "
                             "would have a cycle")

    def add_call(self, call: str, inputs: list[str], output: str) -> None:
        self.check_call(inputs, output)
        self.inputs[call] = list(dict.fromkeys(inputs))
        self.output[call] = output
        self.producer[output] = call
        self.add_variable(output)
        for var in self.inputs[call]:
            self.add_variable(var)
            self.consumers[var].append(call)

    def upstream_variables(self, variables: list[str]) -> set[str]:
        seen: set[str] = set()
        stack = list(variables)
        while stack:
            var = stack.pop()
            if var in seen:
                continue
            seen.add(var)
            call = self.producer.get(var)
            if call is not None:
                stack.extend(self.inputs[call])
        return seen

    def producers_of(self, call: str) -> list[str]:
        return list(dict.fromkeys(self.producer[v] for v in self.inputs[call] if v in self.producer))

    def ancestors(self, call: str) -> set[str]:
        """Calls whose outputs `call` depends on, directly or not."""
        return {self.producer[v] for v in self.upstream_variables(self.inputs[call]) if v in self.producer}

    def set_criteria(self, var: str, criteria: Criteria) -> None:
        if self.criteria.get(var) is not Criteria.LATENCY:
            self.criteria[var] = criteria

    def deduce(self) -> dict[str, CallObjective]:
        """Each call's deduced objective (calls nothing asks about get CallObjective())."""
        criteria: dict[str, Criteria] = {}
        groups: dict[str, str] = {}
        memo: dict[str, set[str]] = {}

        def ancestors(call: str) -> set[str]:
            if call not in memo:
                memo[call] = self.ancestors(call)
            return memo[call]

        def mark(call: str, c: Criteria) -> None:
            if criteria.get(call) is not Criteria.LATENCY:
                criteria[call] = c

        for var, c in self.criteria.items():
            producer = self.producer.get(var)
            if c is Criteria.THROUGHPUT and producer is not None:
                for call in {producer} | ancestors(producer):
                    mark(call, Criteria.THROUGHPUT)
        frontier = [self.producer[v] for v, c in self.criteria.items()
                    if c is Criteria.LATENCY and v in self.producer]
        for call in frontier:
            criteria[call] = Criteria.LATENCY
        visited: set[str] = set()
        while frontier:
            call = frontier.pop()
            if call in visited:
                continue
            visited.add(call)
            producers = self.producers_of(call)
            # A producer that another producer depends on is not parallel to it: it is reached
            # again when the walk continues from the one that depends on it.
            upstream = set().union(*(ancestors(q) for q in producers)) if len(producers) > 1 else set()
            parallel = [p for p in producers if p not in upstream]
            if len(parallel) >= 2:
                for p in parallel:
                    groups.setdefault(p, call)
                    mark(p, Criteria.THROUGHPUT)
            else:
                for p in parallel:
                    mark(p, Criteria.LATENCY)
            frontier.extend(parallel)
        return {call: CallObjective(criteria.get(call), groups.get(call)) for call in self.inputs}
