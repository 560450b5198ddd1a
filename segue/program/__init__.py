"""Parrot-style programs: semantic variables and functions, run server-side as a DAG.

Server side (pure Python and asyncio): variables.py, template.py, transforms.py, graph.py
(DAG and objective deduction), state.py, registry.py, executor.py; wire.py holds the wire
models of `/v1/programs` (segue/server/routes_programs.py). Client side: client.py.
"""
from segue.program.graph import CallObjective, CycleError, ProgramGraph
from segue.program.template import Template, TemplateError
from segue.program.transforms import Transform, TransformError, TransformKind
from segue.program.variables import Criteria, SemanticVariable, VariableError

__all__ = ["CallObjective", "Criteria", "CycleError", "ProgramGraph", "SemanticVariable", "Template",
           "TemplateError", "Transform", "TransformError", "TransformKind", "VariableError"]
