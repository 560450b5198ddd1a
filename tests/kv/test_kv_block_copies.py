"""The physical KV cache's block copies on CPU: slice copies per run of consecutive blocks move
exactly what the index path moves (swaps, swap-ins, write-backs)."""
from __future__ import annotations

import random

import pytest
import torch

from segue.model.kv_tensors import KVTensors, block_runs


def test_block_runs_coalesce_consecutive_pairs_in_order() -> None:
    assert block_runs([]) == []
    assert block_runs([(3, 10), (4, 11), (5, 12), (9, 13), (10, 20), (11, 21)]) == [(3, 10, 3), (9, 13, 1), (10, 20, 2)]
    # Only consecutive on both sides joins, and only in the order given.
    assert block_runs([(1, 1), (2, 3), (3, 4), (2, 2)]) == [(1, 1, 1), (2, 3, 2), (2, 2, 1)]


def _cache() -> KVTensors:
    torch.manual_seed(0)
    cache = KVTensors(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2, num_blocks=12, num_host_blocks=16,
                    device=torch.device("cpu"), dtype=torch.bfloat16)
    for t in (cache.k, cache.v, cache.host_k, cache.host_v):
        t.copy_(torch.randn(t.shape))
    return cache


def _expected(dst: torch.Tensor, src: torch.Tensor, mapping: list[tuple[int, int]]) -> torch.Tensor:
    out = dst.clone()
    src_ids, dst_ids = torch.tensor([s for s, _ in mapping]), torch.tensor([d for _, d in mapping])
    out.index_copy_(2, dst_ids, src.index_select(2, src_ids))
    return out


def test_swaps_and_write_backs_move_exactly_the_mapped_blocks() -> None:
    rng = random.Random(1)
    for _ in range(20):
        cache = _cache()
        n = rng.randint(1, 10)
        # Mixed runs: some consecutive on both sides, some scattered.
        device_ids = sorted(rng.sample(range(12), n)) if rng.random() < 0.5 else rng.sample(range(12), n)
        host_ids = list(range(3, 3 + n)) if rng.random() < 0.5 else rng.sample(range(16), n)
        out_map = list(zip(device_ids, host_ids, strict=True))
        want_k, want_v = _expected(cache.host_k, cache.k, out_map), _expected(cache.host_v, cache.v, out_map)
        (cache.swap_out if rng.random() < 0.5 else cache.back_up)(out_map)
        assert torch.equal(cache.host_k, want_k) and torch.equal(cache.host_v, want_v)
        in_map = [(h, d) for d, h in out_map]
        cache.k.zero_()
        want_k = _expected(cache.k, cache.host_k, in_map)
        cache.swap_in(in_map)
        assert torch.equal(cache.k, want_k)


def test_cpu_swaps_are_done_before_the_forward_pass() -> None:
    # A CPU copies before the forward pass, not beside it (KVTensors.start_swaps): done on return.
    cache = _cache()
    want = _expected(cache.k, cache.host_k, [(0, 5), (1, 6), (7, 2)])
    handle = cache.start_swaps([(0, 5), (1, 6), (7, 2)], [])
    assert torch.equal(cache.k, want)
    handle.wait()
    assert torch.equal(cache.k, want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("path", ["swap_out", "start_swaps"])
def test_cuda_swap_out_and_back_is_bitwise_exact(path: str) -> None:
    """A swap-out's device-to-host copy is asynchronous: the host pool must get the bytes once
    they have landed, not whatever the landing buffer held when the CPU read it."""
    torch.manual_seed(0)
    # Tens of MB, queued behind a busy stream: a host read that does not wait would see the copy
    # unfinished.
    cache = KVTensors(num_layers=4, num_kv_heads=8, head_dim=64, block_size=16, num_blocks=512, num_host_blocks=512,
                    device=torch.device("cuda"), dtype=torch.bfloat16)
    cache.k.copy_(torch.randn(cache.k.shape, device="cuda"))
    cache.v.copy_(torch.randn(cache.v.shape, device="cuda"))
    cache.host_k.zero_()
    cache.host_v.zero_()
    rng = random.Random(0)
    device_ids, host_ids = rng.sample(range(512), 384), rng.sample(range(512), 384)
    out_map = list(zip(device_ids, host_ids, strict=True))
    want_k, want_v = cache.k[:, :, device_ids].cpu(), cache.v[:, :, device_ids].cpu()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        torch.mm(busy, busy)
    if path == "swap_out":
        cache.swap_out(out_map)
    else:
        cache.start_swaps([], out_map).wait()
        cache.settle()  # the scatter into the host pool runs off the engine thread (model/host_writes.py)
    assert torch.equal(cache.host_k[:, :, host_ids], want_k) and torch.equal(cache.host_v[:, :, host_ids], want_v)
    # The host copy is the only one left: back into the device blocks, bit for bit.
    cache.k.zero_()
    cache.v.zero_()
    cache.start_swaps([(h, d) for d, h in out_map], []).wait()
    torch.cuda.synchronize()
    assert torch.equal(cache.k[:, :, device_ids].cpu(), want_k) and torch.equal(cache.v[:, :, device_ids].cpu(), want_v)
    # Swaps no larger than the first reuse its pinned staging buffers (one each for K and V).
    allocated = cache.host_writes.num_allocations
    for _ in range(3):
        cache.start_swaps([], out_map[:100]).wait()
    cache.settle()
    assert cache.host_writes.num_allocations == allocated == 2


def test_host_writes_reuse_their_staging_buffers_and_scatter_off_the_calling_thread() -> None:
    """The last leg of a CUDA swap-out, on CPU tensors (model/host_writes.py): one buffer per pool
    name, grown only for a larger swap; the scatter into the host pool runs on a worker thread and
    is in the pool once settle() returns."""
    import threading

    from segue.model.host_writes import HostWrites

    writes = HostWrites(pin=False)
    host = torch.zeros(2, 3, 8, 4)
    a = writes.landing("k", torch.Size([2, 3, 2, 4]), torch.float32)
    b = writes.landing("k", torch.Size([2, 3, 1, 4]), torch.float32)
    assert a.data_ptr() == b.data_ptr() and writes.num_allocations == 1
    writes.landing("v", torch.Size([2, 3, 2, 4]), torch.float32)
    writes.landing("k", torch.Size([2, 3, 5, 4]), torch.float32)   # larger: grown once
    assert writes.num_allocations == 3
    staged = writes.landing("k", torch.Size([2, 3, 2, 4]), torch.float32)
    staged.copy_(torch.arange(48, dtype=torch.float32).view(2, 3, 2, 4))
    seen: list[str] = []
    release = threading.Event()

    def landed() -> None:  # stands for the copies' CUDA event
        seen.append(threading.current_thread().name)
        assert release.wait(10)
    writes.scatter([(host, torch.tensor([6, 1]), staged)], landed)
    # The caller goes on while the worker waits for the copies to land.
    assert host.abs().sum() == 0
    release.set()
    writes.settle()
    assert seen and seen[0] != threading.current_thread().name
    assert torch.equal(host[:, :, 6], staged[:, :, 0]) and torch.equal(host[:, :, 1], staged[:, :, 1])
    writes.close()
