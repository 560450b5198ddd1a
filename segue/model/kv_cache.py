"""The physical KV cache: one tensor pair per pool, laid out [layer, kv_head, block, slot, dim].

Head-major blocks make a gathered set of blocks land as [kv_head, tokens, dim], the shape the
grouped-query matmuls want, with no transpose copy.
"""
from __future__ import annotations

import torch


class KVCache:
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
        ks.index_copy_(1, slot_mapping, k.transpose(0, 1))
        vs.index_copy_(1, slot_mapping, v.transpose(0, 1))

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: mapping is [(device_id, host_id)]."""
        if not mapping:
            return
        src = torch.tensor([d for d, _ in mapping], device=self.k.device)
        dst = torch.tensor([h for _, h in mapping])
        self.host_k.index_copy_(2, dst, self.k.index_select(2, src).to("cpu"))
        self.host_v.index_copy_(2, dst, self.v.index_select(2, src).to("cpu"))

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: mapping is [(host_id, device_id)]."""
        if not mapping:
            return
        src = torch.tensor([h for h, _ in mapping])
        dst = torch.tensor([d for _, d in mapping], device=self.k.device)
        self.k.index_copy_(2, dst, self.host_k.index_select(2, src).to(self.k.device, non_blocking=True))
        self.v.index_copy_(2, dst, self.host_v.index_select(2, src).to(self.v.device, non_blocking=True))
