"""The last leg of a CUDA swap-out: device blocks land in pinned staging buffers (the copy engine
writes them while the forward pass runs), then go into their places in the host pool.

Two costs used to sit on the engine thread with every swap: a pinned buffer allocated per swap
(cudaHostAlloc maps and locks pages, milliseconds for the tens of MB a swap moves, and more than
the copy it serves for small ones), and the host-side scatter into the pool after the copies
landed (a memcpy of everything swapped, between one step's forward and the next step's
scheduling). Here the staging buffers are kept and reused, grown to the largest swap seen, and
the scatter runs on a worker thread of its own; torch releases the GIL in the copy, so the
engine thread schedules and launches the next step meanwhile.

The host pool holds the bytes once `settle()` returns. Every use of the pool or of the staging
buffers settles first (KVTensors: swap-in, write-back, the next swap-out), so nothing reads a host
block before its bytes are there, and no swap reuses a buffer the last scatter still reads.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

# (host pool, its block ids, the blocks as they landed)
Write = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class HostWrites:
    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._buffers: dict[str, torch.Tensor] = {}
        self._worker: ThreadPoolExecutor | None = None
        self._inflight: Future[None] | None = None
        # Buffers allocated so far (a test reads it: a swap no larger than one before allocates none).
        self.num_allocations = 0

    def landing(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A staging buffer of `shape` for the pool `name` ("k", "v"), reused across swaps: grown
        (to a power of two elements) only when a swap is larger than every one before."""
        self.settle()  # the last scatter may still read it
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            size = 1 << max(0, numel - 1).bit_length()
            buf = torch.empty(size, dtype=dtype, pin_memory=self._pin)
            self._buffers[name] = buf
            self.num_allocations += 1
        return buf[:numel].view(shape)

    def scatter(self, writes: list[Write], landed: Callable[[], None] | None = None) -> None:
        """Put each landed block into its host pool, on the worker thread, once `landed()` (the
        copies' event) returns; `settle()` waits for it."""
        self.settle()
        if not writes:
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="segue-kv-host-writes")

        def run() -> None:
            if landed is not None:
                landed()
            for host, dst, staged in writes:
                host.index_copy_(2, dst, staged)
        self._inflight = self._worker.submit(run)

    def settle(self) -> None:
        """Return once the last scatter is in the host pool (raising what it raised, if it failed)."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()

    def close(self) -> None:
        self.settle()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
