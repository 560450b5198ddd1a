"""Constrained decoding: grammars (JSON schemas, tool-call formats, regexes) that restrict which
tokens a request may sample, through llguidance.

Only spec.py is imported by pure-Python code (SamplingParams); the grammar library is imported by
backend.py and bitmask.py, which only the engine and the model executor load, so the scheduler,
the KV manager and the simulator never depend on it.
"""
from segue.structured.spec import StructuredKind, StructuredSpec

__all__ = ["StructuredKind", "StructuredSpec"]
