"""Programs and variables by id, each reachable only by the tenant (API key) that created it.

Another tenant's id answers exactly like an unknown one, so ids leak nothing across keys. Programs
that no client has touched for a while and that have nothing in the engine expire (calls still
waiting for an input nobody sets do not keep them alive), because a client that never deletes
its programs must not grow the server without bound.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from segue.engine.engine_request import RequestHints
from segue.program.state import LimitError, NotFoundError, Program
from segue.program.variables import SemanticVariable


@dataclass
class ProgramLimits:
    max_programs: int = 1024
    # One tenant cannot take every slot from the others.
    max_programs_per_owner: int = 256
    max_variables_per_program: int = 4096
    max_calls_per_program: int = 2048
    # Programs with no call waiting or running are dropped after this many idle seconds.
    idle_ttl_s: float = 3600.0


def scoped_program_id(owner: str | None, program_id: str) -> str:
    """The engine's name for a tenant's program (program-level policies, replica binding). Program
    ids in chat and completion requests are client-chosen labels, so two tenants naming the same id
    must not become one program, nor may one tenant add to another's program by naming its id."""
    return program_id if owner is None else f"{owner}/{program_id}"


class ProgramRegistry:
    def __init__(self, limits: ProgramLimits | None = None,
                 on_drop: Callable[[Program], None] | None = None) -> None:
        self.limits = limits or ProgramLimits()
        self.programs: dict[str, Program] = {}
        self._var_index: dict[str, str] = {}
        self._on_drop = on_drop

    def create(self, owner: str | None, hints: RequestHints | None = None) -> Program:
        self.expire()
        if len(self.programs) >= self.limits.max_programs:
            raise LimitError(f"the server holds {len(self.programs)} programs, its limit; delete finished "
                             "programs (DELETE /v1/programs/{id})")
        owned = sum(1 for p in self.programs.values() if p.owner == owner)
        if owned >= self.limits.max_programs_per_owner:
            raise LimitError(f"this API key holds {owned} programs, its limit; delete finished programs "
                             "(DELETE /v1/programs/{id})")
        program = Program(owner, hints or RequestHints())
        self.programs[program.id] = program
        return program

    def program(self, owner: str | None, program_id: str) -> Program:
        program = self.programs.get(program_id)
        if program is None or program.owner != owner:
            raise NotFoundError(f"program {program_id!r} does not exist")
        program.touch()
        return program

    def variable(self, owner: str | None, var_id: str) -> tuple[Program, SemanticVariable]:
        program = self.programs.get(self._var_index.get(var_id, ""))
        if program is None or program.owner != owner or var_id not in program.variables:
            raise NotFoundError(f"variable {var_id!r} does not exist")
        program.touch()
        return program, program.variables[var_id]

    def check_variable_room(self, program: Program, count: int = 1) -> None:
        if len(program.variables) + count > self.limits.max_variables_per_program:
            raise LimitError(f"program {program.id!r} has {len(program.variables)} variables; the limit is "
                             f"{self.limits.max_variables_per_program}")

    def add_variable(self, program: Program, var: SemanticVariable) -> None:
        self.check_variable_room(program)
        program.variables[var.id] = var
        program.graph.add_variable(var.id)
        self._var_index[var.id] = program.id

    def check_call_limit(self, program: Program) -> None:
        if len(program.calls) >= self.limits.max_calls_per_program:
            raise LimitError(f"program {program.id!r} has {len(program.calls)} calls, the limit")

    def delete(self, owner: str | None, program_id: str) -> Program:
        program = self.program(owner, program_id)
        self._drop(program)
        return program

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        idle = [p for p in self.programs.values()
                if not p.is_running and now - p.last_used > self.limits.idle_ttl_s]
        for program in idle:
            self._drop(program)
        return len(idle)

    def drop_all(self) -> None:
        for program in list(self.programs.values()):
            self._drop(program)

    def _drop(self, program: Program) -> None:
        self.programs.pop(program.id, None)
        for var_id in program.variables:
            self._var_index.pop(var_id, None)
        if self._on_drop is not None:
            self._on_drop(program)
