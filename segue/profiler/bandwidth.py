"""A STREAM-like probe of this machine's memory read bandwidth, with the threads torch runs.

Decoding one sequence reads every weight once a step, so the best a decode step can do is the
weights' bytes over this bandwidth; `segue bench step-profile` reports the share of it a step
achieves. The probe reads a buffer far larger than any last-level cache with torch's vectorized,
multi-threaded reductions (the best of a few reads: others' load only slows a read down).
"""
from __future__ import annotations

import time

PROBE_BYTES = 1 << 30


def read_bandwidth_gbs(nbytes: int = PROBE_BYTES, reps: int = 5) -> float:
    """GB/s (1e9 bytes) of the fastest of `reps` full reads of an `nbytes` buffer."""
    import torch

    buf = torch.ones(nbytes // 4, dtype=torch.float32)  # written once: every page is resident
    best = float("inf")
    for _ in range(reps + 1):  # the first read warms nothing a later one needs, but pays page faults
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9
