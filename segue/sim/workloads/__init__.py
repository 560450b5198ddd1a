"""Workloads: real traces and synthetic generators, as lists of TraceRequest."""
from segue.sim.workloads.trace_request import TraceRequest

__all__ = ["TraceRequest"]
