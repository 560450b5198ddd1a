"""A program's server-side state: its calls, its variables and its DAG, plus the errors the API maps
to HTTP statuses."""
from __future__ import annotations

import asyncio
import enum
import time
import uuid
from dataclasses import dataclass, field

from segue.engine.engine_request import RequestHints
from segue.program.graph import ProgramGraph
from segue.program.template import Template
from segue.program.transforms import Transform
from segue.program.variables import SemanticVariable
from segue.sampling_params import SamplingParams


class ProgramError(Exception):
    """Base of the errors a client can cause; `status` is the HTTP status the API answers with."""
    status = 400
    code = "invalid_program"


class NotFoundError(ProgramError):
    # Also what another tenant's ids get: existence is not revealed across API keys.
    status = 404
    code = "not_found"


class ConflictError(ProgramError):
    status = 409
    code = "variable_conflict"


class LimitError(ProgramError):
    status = 429
    code = "too_many_program_objects"


class CallState(str, enum.Enum):
    WAITING = "waiting"      # for its inputs
    RUNNING = "running"      # submitted to the engine
    DONE = "done"
    FAILED = "failed"


@dataclass
class CallSpec:
    """A submitted call, validated but not yet part of a program."""
    template: Template
    # Placeholder name -> variable id; with `literals`, one entry per input placeholder.
    inputs: dict[str, str]
    params: SamplingParams
    # Placeholder name -> a value given inline: the call gets a fresh variable holding it, which
    # saves the client a round trip per value.
    literals: dict[str, str] = field(default_factory=dict)
    # max_tokens was not given: the rest of the context (capped) once the prompt is rendered.
    default_max_tokens: bool = False
    transforms: list[Transform] = field(default_factory=list)
    # Write into this existing, unset variable instead of a new one.
    output_id: str | None = None


@dataclass(eq=False)
class Call:
    program_id: str
    spec: CallSpec
    inputs: dict[str, SemanticVariable]
    output: SemanticVariable
    id: str = field(default_factory=lambda: f"call-{uuid.uuid4().hex}")
    state: CallState = CallState.WAITING
    # What the engine was told when the call launched (fixed from then on).
    priority: int | None = None
    criteria: str | None = None
    task_group: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    # time.monotonic() of the call's milestones: submitted, inputs ready, sent to the engine, done.
    times: dict[str, float] = field(default_factory=lambda: {"submitted": time.monotonic()})
    task: asyncio.Task | None = None


@dataclass(eq=False)
class Program:
    owner: str | None
    # Engine hints every call of the program carries (the tenant's prefix-cache salt); each call
    # adds its own priority, program id and objective.
    hints: RequestHints = field(default_factory=RequestHints)
    id: str = field(default_factory=lambda: f"prog-{uuid.uuid4().hex}")
    graph: ProgramGraph = field(default_factory=ProgramGraph)
    variables: dict[str, SemanticVariable] = field(default_factory=dict)
    calls: dict[str, Call] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    last_used: float = field(default_factory=time.monotonic)

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def variable_by_id(self, var_id: str) -> SemanticVariable:
        var = self.variables.get(var_id)
        if var is None:
            raise NotFoundError(f"variable {var_id!r} does not exist in program {self.id!r}")
        return var

    @property
    def is_running(self) -> bool:
        """Some call is in the engine (a waiting call may wait forever for an input nobody sets)."""
        return any(c.state is CallState.RUNNING for c in self.calls.values())
