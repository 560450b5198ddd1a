"""The physical KV cache: one tensor pair per pool, laid out [layer, kv_head, block, slot, dim].

Head-major blocks make a gathered set of blocks land as [kv_head, tokens, dim], the shape the
grouped-query matmuls want, with no transpose copy.

Named KVTensors, not KVCache: `segue/kv/interface.py`'s KVCache is the scheduler's view of the same
memory (blocks, prefixes, tiers), and this is only where the numbers live.
"""
from __future__ import annotations

import torch

from segue.model.host_writes import HostWrites


class KVTensors:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_blocks: int, num_host_blocks: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        host_shape = (num_layers, num_kv_heads, max(num_host_blocks, 0), block_size, head_dim)
        pin = device.type == "cuda"
        # Host blocks are only read after being written, so pages are left untouched until used
        # (zeroing a large swap pool would cost seconds at start-up). Device blocks are zeroed:
        # padded decode attention reads unwritten slots under a mask, and 0 * NaN is NaN.
        self.host_k = torch.empty(host_shape, dtype=dtype, pin_memory=pin)
        self.host_v = torch.empty(host_shape, dtype=dtype, pin_memory=pin)
        # CUDA swap-outs' staging buffers and their scatter into the host pool (model/host_writes.py).
        self.host_writes = HostWrites(pin)

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * block_size * head_dim * torch.tensor([], dtype=dtype).element_size()

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [kv_head, num_blocks * block_size, dim] of one layer."""
        k, v = self.k[layer], self.v[layer]
        return k.view(k.shape[0], -1, k.shape[-1]), v.view(v.shape[0], -1, v.shape[-1])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: [T, kv_head, dim] for the tokens of this step, stored at their slots."""
        ks, vs = self.layer_slots(layer)
        ks.index_copy_(1, slot_mapping, k.transpose(0, 1).to(ks.dtype))
        vs.index_copy_(1, slot_mapping, v.transpose(0, 1).to(vs.dtype))

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: mapping is [(device_id, host_id)]. Done on return."""
        writes, event = self._start_swap_out(mapping)
        if event is not None:
            event.synchronize()
        self.host_writes.scatter(writes)
        self.host_writes.settle()

    def settle(self) -> None:
        """Return once every swap-out started so far is in the host pool (CUDA: its scatter runs
        off the engine thread; see model/host_writes.py). What reads the pool here settles first."""
        self.host_writes.settle()

    def _start_swap_out(self, mapping: list[tuple[int, int]]) -> tuple[list, torch.cuda.Event | None]:
        """Start a swap-out on the current stream: the blocks land in the staging buffers once the
        returned event (None: nothing pending) completes, then go into the host pool
        (HostWrites.scatter). On a CPU it is done here."""
        if not mapping:
            return [], None
        self.settle()
        if not self.k.is_cuda:
            _copy_blocks(self.host_k, self.k, mapping)
            _copy_blocks(self.host_v, self.v, mapping)
            return [], None
        src = torch.tensor([d for d, _ in mapping], device=self.k.device)
        dst = torch.tensor([h for _, h in mapping])
        writes = []
        for name, cache, host in (("k", self.k, self.host_k), ("v", self.v, self.host_v)):
            staged = cache.index_select(2, src)
            # A non-blocking copy to the host returns before the bytes land: a CPU read of its
            # result (the index_copy_ into the host pool) would take whatever was there before,
            # and the swapped-out context would come back corrupted. The copy lands in a pinned
            # staging buffer, read only after the event below says it is complete.
            landing = self.host_writes.landing(name, staged.shape, staged.dtype)
            landing.copy_(staged, non_blocking=True)
            writes.append((host, dst, landing))
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.k.device))
        return writes, event

    def back_up(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks now, before anything else in the step (write-back of
        evicted prefix-cache blocks): the device blocks are overwritten later in the same step."""
        if not mapping:
            return
        if not self.k.is_cuda:
            self.swap_out(mapping)
            return
        self.settle()
        src = torch.tensor([d for d, _ in mapping], device=self.k.device)
        dst = torch.tensor([h for _, h in mapping])
        for cache, host in ((self.k, self.host_k), (self.v, self.host_v)):
            host.index_copy_(2, dst, cache.index_select(2, src).to("cpu"))

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: mapping is [(host_id, device_id)]."""
        if not mapping:
            return
        self.settle()  # a block swapped out in an earlier step may still be on its way in
        if not self.k.is_cuda:
            _copy_blocks(self.k, self.host_k, mapping)
            _copy_blocks(self.v, self.host_v, mapping)
            return
        src = torch.tensor([h for h, _ in mapping])
        dst = torch.tensor([d for _, d in mapping], device=self.k.device)
        for cache, host in ((self.k, self.host_k), (self.v, self.host_v)):
            staged = host.index_select(2, src)
            if cache.is_cuda:
                staged = staged.pin_memory().to(cache.device, non_blocking=True)
            cache.index_copy_(2, dst, staged)

    def start_swaps(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]) -> "SwapHandle":
        """Start this step's copies: on CUDA on a side stream, beside the forward pass (safe because
        swapped-in blocks are not read before the next step and swapped-out blocks stay reserved
        until then: KVCacheManager.release_swapped_out). On a CPU they run here, before the
        forward pass, on every core: a CPU has no copy engine, so a copy beside the forward takes
        a core from it, and the forward's threads wait for that core at every barrier. On 2 cores
        a decode step took 12.9 ms alone and 28.1 ms beside a thread copying blocks (21.2 ms with
        that thread on one core), where the same copies run before it at ~10 GB/s."""
        if not swap_in and not swap_out:
            return SwapHandle(None)
        if self.k.is_cuda:
            stream = torch.cuda.Stream(device=self.k.device)
            stream.wait_stream(torch.cuda.current_stream(self.k.device))
            with torch.cuda.stream(stream):
                self.swap_in(swap_in)
                writes, _ = self._start_swap_out(swap_out)
                event = torch.cuda.Event()
                event.record(stream)

            def wait() -> None:
                # The device blocks are read once this returns (the next step may reuse them);
                # their bytes go into the host pool on HostWrites' thread, which any reader of
                # the pool waits for (settle), not on the engine thread.
                event.synchronize()
                self.host_writes.scatter(writes)
            return SwapHandle(wait)
        self.swap_in(swap_in)
        self.swap_out(swap_out)
        return SwapHandle(None)


def block_runs(mapping: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """[(src, dst)] block pairs as (src_start, dst_start, length) runs of consecutive ids on both
    sides, in the given order: one copy per run."""
    runs: list[list[int]] = []
    for src, dst in mapping:
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[2] == src and last[1] + last[2] == dst:
            last[2] += 1
        else:
            runs.append([src, dst, 1])
    return [(s, d, n) for s, d, n in runs]


def _copy_blocks(dst: torch.Tensor, src: torch.Tensor, mapping: list[tuple[int, int]]) -> None:
    """Block copies between two CPU pools ([layer, kv_head, block, slot, dim]), a slice copy per
    run of consecutive blocks. index_select + index_copy_ move the same bytes at 1.4 GB/s on one
    core (bf16, the default model's 23 KB per token; a fresh staging tensor each call); slice
    copies at 8 GB/s (BENCHMARKS.md), which is what a swap costs the step beside it on a CPU."""
    for s, d, n in block_runs(mapping):
        dst[:, :, d:d + n].copy_(src[:, :, s:s + n])


class SwapHandle:
    def __init__(self, wait) -> None:
        self._wait = wait

    def wait(self) -> None:
        if self._wait is not None:
            self._wait()
            self._wait = None
