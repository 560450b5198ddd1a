"""Integer arithmetic every layer needs: blocks for a number of tokens, chunks for a length.

Its own module so that the executor, the profiler and the simulator divide without importing the
KV cache's interface."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (for b > 0): the blocks `a` tokens take at `b` tokens a block."""
    return -(-a // b)
