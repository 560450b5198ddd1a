"""Program-level least attained service (Autellix's PLAS): a request is ranked by the service its
whole program has received, so a short agent program is not stuck behind the tenth call of a long
one, whatever the length of the single call.

Program: `Request.program_id` (the API's `program_id`; the server uses the session id when a
session turn names none). A request without one is a program of its own. Service is what the
program's requests computed (prompt and output tokens, or their profiled T_fwd seconds);
recomputing a discarded or evicted context is not service. A program's finished requests keep
counting until the program has had no request in the system for `forget_after_s`; then it is
forgotten, so memory stays bounded by the programs active in that window.

Order (ascending key): starving requests first (FCFS among them), then by the level of the
program's attained service (level 0 below `base_quantum`, each next level twice as wide, as in
Autellix's discretized queues, so two programs with nearly equal service do not swap places
every step), then by `priority`, then by arrival. `priority` follows vLLM: lower values first.
With `priority_as_class` it ranks before the service level instead (strict classes: a lower
class waits until the higher is served, except for the starvation bound).

Anti-starvation: a request that has waited (in the queue, not in a tool or human pause) at least
`starvation_ratio` times its own service seconds, and at least `min_starvation_wait_s`, goes to
the front. Its wait restarts whenever it runs, so the bound holds between any two services.

Options (`scheduler.policy_options`):
  service_unit           "tokens" (default) or "time" (profiled T_fwd of each scheduled chunk)
  base_quantum           service of level 0, in service_unit (default 2048 tokens / 0.5 s)
  num_levels             levels of attained service (default 10; the last one is unbounded)
  starvation_ratio       wait / service ratio that promotes a request (default 10)
  min_starvation_wait_s  no request is promoted before waiting this long (default 1.0)
  forget_after_s         an idle program's service is kept this long (default 60)
  priority_as_class      priority ranks before service instead of breaking ties (default False)
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

from segue.request import Request
from segue.sched.policies.base import PolicyContext, SchedulingPolicy

_DEFAULT_QUANTUM = {"tokens": 2048.0, "time": 0.5}


@dataclass
class ProgramLASOptions:
    service_unit: str = "tokens"
    base_quantum: float | None = None
    num_levels: int = 10
    starvation_ratio: float = 10.0
    min_starvation_wait_s: float = 1.0
    forget_after_s: float = 60.0
    priority_as_class: bool = False

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> "ProgramLASOptions":
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown program-las options {sorted(unknown)}; "
                             f"known: {sorted(cls.__dataclass_fields__)}")
        opts = cls(**options)
        if opts.service_unit not in _DEFAULT_QUANTUM:
            raise ValueError(f"program-las service_unit must be one of {sorted(_DEFAULT_QUANTUM)}")
        if opts.base_quantum is None:
            opts.base_quantum = _DEFAULT_QUANTUM[opts.service_unit]
        if opts.base_quantum <= 0 or opts.num_levels < 1:
            raise ValueError("program-las base_quantum must be positive and num_levels >= 1")
        if opts.starvation_ratio <= 0 or opts.min_starvation_wait_s < 0 or opts.forget_after_s < 0:
            raise ValueError("program-las starvation_ratio must be positive, min_starvation_wait_s and "
                             "forget_after_s non-negative")
        return opts


@dataclass
class ProgramState:
    attained: float = 0.0
    # Its requests in the system (running, waiting or paused).
    live: int = 0
    idle_since: float = 0.0


@dataclass
class RequestEntry:
    program: str
    served_s: float = 0.0
    # When it last ran, arrived or came back from a pause: its wait for service started then.
    waiting_since: float = 0.0
    paused: bool = False


class ProgramLASPolicy(SchedulingPolicy):
    name = "program-las"
    # A request of a program with less service takes the step from one with more.
    preemptive: ClassVar[bool] = True

    def __init__(self, context: PolicyContext | None = None) -> None:
        super().__init__(context)
        self.options = ProgramLASOptions.from_dict(dict(self.context.options))
        self.programs: dict[str, ProgramState] = {}
        # Programs with no live request, oldest idle first (the order they are forgotten in).
        self._idle: OrderedDict[str, None] = OrderedDict()
        self.entries: dict[str, RequestEntry] = {}

    @staticmethod
    def program_of(request: Request) -> str:
        # Namespaced so a client's program id can never name another request's own program.
        return f"p:{request.program_id}" if request.program_id is not None else f"r:{request.request_id}"

    # ---- ranking -------------------------------------------------------------------------
    def level(self, attained: float) -> int:
        q = self.options.base_quantum
        assert q is not None
        if attained < q:
            return 0
        return min(self.options.num_levels - 1, int(math.log2(attained / q)) + 1)

    def starving(self, entry: RequestEntry, now: float) -> bool:
        waited = now - entry.waiting_since
        return (not entry.paused and waited >= self.options.min_starvation_wait_s
                and waited >= self.options.starvation_ratio * entry.served_s)

    def key(self, request: Request, now: float) -> tuple:
        entry = self.entries.get(request.request_id)
        if entry is None:  # never announced: behind everything known, FCFS among themselves
            return (2, 0, 0, 0, request.sched_arrival_time, request.seq_no)
        if self.starving(entry, now):
            return (0, 0, 0, 0, entry.waiting_since, request.seq_no)
        level = self.level(self.programs[entry.program].attained)
        if self.options.priority_as_class:
            return (1, request.priority, level, 0, request.sched_arrival_time, request.seq_no)
        return (1, 0, level, request.priority, request.sched_arrival_time, request.seq_no)

    def attained(self, request: Request) -> float:
        """The attained service of `request`'s program (0 if it has none yet or was forgotten)."""
        state = self.programs.get(self.program_of(request))
        return state.attained if state is not None else 0.0

    # ---- hooks ---------------------------------------------------------------------------
    def on_arrival(self, request: Request, now: float) -> None:
        name = self.program_of(request)
        state = self.programs.get(name)
        if state is None:
            state = self.programs[name] = ProgramState()
        state.live += 1
        self._idle.pop(name, None)
        self.entries[request.request_id] = RequestEntry(name, waiting_since=now)

    def on_step(self, now: float) -> None:
        horizon = now - self.options.forget_after_s
        while self._idle:
            name = next(iter(self._idle))
            if self.programs[name].idle_since > horizon:
                break
            del self._idle[name]
            del self.programs[name]

    def on_scheduled(self, request: Request, num_tokens: int, now: float) -> None:
        entry = self.entries.get(request.request_id)
        if entry is None:
            return
        entry.waiting_since = now
        start = request.num_computed_tokens
        fresh = num_tokens - max(0, min(request.max_computed_tokens, start + num_tokens) - start)
        if fresh <= 0:
            return
        seconds = self.context.cost.t_fwd(fresh)
        entry.served_s += seconds
        self.programs[entry.program].attained += seconds if self.options.service_unit == "time" else fresh

    def on_intercepted(self, request: Request, now: float) -> None:
        entry = self.entries.get(request.request_id)
        if entry is not None:
            entry.paused = True

    def on_resumed(self, request: Request, now: float) -> None:
        entry = self.entries.get(request.request_id)
        if entry is not None:
            # The tool's (or the human's) time is not starvation: the wait starts now.
            entry.paused = False
            entry.waiting_since = now

    def on_finished(self, request: Request, now: float) -> None:
        entry = self.entries.pop(request.request_id, None)
        if entry is None:
            return
        state = self.programs[entry.program]
        state.live -= 1
        if state.live > 0:
            return
        if request.program_id is None:  # a program of one request: nobody can add to it
            del self.programs[entry.program]
        else:
            state.idle_since = now
            self._idle[entry.program] = None
