"""Workloads: real traces and synthetic generators, as lists of TraceRequest."""
from segue.bench.workloads.trace_request import TraceRequest

__all__ = ["TraceRequest"]
