"""Wire models of the programs API (`/v1/programs/...`) and their translation to CallSpec.

Known fields are strict (a string where a number belongs is a 400, as in the OpenAI routes);
unknown fields are rejected too, because a misspelt transform or input silently ignored would
run a different program than the client wrote.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from segue.program.graph import CallObjective
from segue.program.state import Call, CallSpec, Program
from segue.program.template import Template, TemplateError
from segue.program.transforms import Transform, TransformKind
from segue.program.variables import Criteria, SemanticVariable
from segue.sampling_params import InvalidRequestError, SamplingParams

MAX_VALUE_CHARS = 1_000_000


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ProgramCreate(_Body):
    pass


class VariableCreate(_Body):
    program_id: str = Field(max_length=64)
    name: str = Field(default="var", min_length=1, max_length=64)
    # Omitted: an empty variable, set later (POST /v1/programs/variables/{id}) or written by a call.
    value: str | None = Field(default=None, max_length=MAX_VALUE_CHARS)


class VariableSet(_Body):
    value: str = Field(max_length=MAX_VALUE_CHARS)


class TransformIn(_Body):
    type: Literal["strip", "json_field", "regex"]
    path: str | None = Field(default=None, max_length=512)
    pattern: str | None = None
    group: int = Field(default=0, ge=0, le=99)

    def to_transform(self) -> Transform:
        try:
            return Transform(TransformKind(self.type), self.path, self.pattern, self.group)
        except ValueError as e:
            raise InvalidRequestError(f"transforms: {e}") from None


class InlineValue(_Body):
    value: str = Field(max_length=MAX_VALUE_CHARS)


class CallCreate(_Body):
    program_id: str = Field(max_length=64)
    # Text with {{input:name}} placeholders and one {{output:name}} placeholder at the end.
    template: str = Field(min_length=1, max_length=MAX_VALUE_CHARS)
    # Input placeholder name -> variable id, or {"value": "..."} for a value given inline.
    inputs: dict[str, str | InlineValue] = Field(default_factory=dict)
    # Write into this existing, empty variable; omitted: a new variable named after the placeholder.
    output_variable: str | None = Field(default=None, max_length=64)
    transforms: list[TransformIn] = Field(default_factory=list, max_length=16)
    # Declare up front what the output is awaited for, as a get with this criteria would.
    criteria: Criteria | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None

    def to_spec(self) -> CallSpec:
        try:
            template = Template.parse(self.template)
        except TemplateError as e:
            raise InvalidRequestError(f"template: {e}") from None
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}
        params = SamplingParams.from_request(self.max_tokens if self.max_tokens is not None else 1, self.stop,
                                             self.ignore_eos, given)
        ids = {k: v for k, v in self.inputs.items() if isinstance(v, str)}
        literals = {k: v.value for k, v in self.inputs.items() if isinstance(v, InlineValue)}
        return CallSpec(template, ids, params, literals, default_max_tokens=self.max_tokens is None,
                        transforms=[t.to_transform() for t in self.transforms], output_id=self.output_variable)


def program_json(program: Program, detail: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"id": program.id, "object": "program", "created": program.created}
    if detail:
        out["variables"] = [variable_json(v) for v in program.variables.values()]
        deduced = program.graph.deduce()
        out["calls"] = [call_json(c, deduced.get(c.id)) for c in program.calls.values()]
    return out


def variable_json(var: SemanticVariable, with_value: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"id": var.id, "object": "program.variable", "program_id": var.program_id,
                           "name": var.name, "status": var.state.value, "producer": var.producer,
                           "criteria": var.criteria.value if var.criteria else None}
    if with_value and var.value is not None:
        out["value"] = var.value
    if var.error is not None:
        out["error"] = {"message": str(var.error), "step": var.error.step}
    return out


def call_json(call: Call, deduced: CallObjective | None = None) -> dict[str, Any]:
    """`engine` is what the engine was told when the call launched (fixed from then on);
    `objective` is what the program's DAG deduces now, from every get so far."""
    out: dict[str, Any] = {
        "id": call.id, "object": "program.call", "program_id": call.program_id, "status": call.state.value,
        "inputs": {n: v.id for n, v in call.inputs.items()},
        "output": {"name": call.output.name, "id": call.output.id},
        "engine": {"priority": call.priority, "criteria": call.criteria, "task_group": call.task_group},
        "prompt_tokens": call.prompt_tokens, "cached_tokens": call.cached_tokens,
        # Seconds since submission at which the inputs were ready, the engine got it, it finished.
        "timing": {k: round(t - call.times["submitted"], 6) for k, t in call.times.items() if k != "submitted"}}
    if deduced is not None:
        out["objective"] = {"criteria": deduced.criteria.value if deduced.criteria else None,
                            "task_group": deduced.task_group, "priority": deduced.priority}
    return out
