"""Per-request block tables over a device pool (with prefix caching) and a host pool for swapping."""
from __future__ import annotations

from collections import Counter

from segue.kv.block_pool import BlockPool, KVBlock
from segue.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, block_size: int, num_device_blocks: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, hash_salt: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_salt = hash_salt
        self.device = BlockPool(num_device_blocks, enable_prefix_caching, "device")
        self.host = BlockPool(num_host_blocks, False, "host") if num_host_blocks > 0 else None
        self.tables: dict[str, list[KVBlock]] = {}
        self.host_tables: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are already published in the prefix cache.
        self._num_registered: dict[str, int] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.device.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(self.tables.get(request.request_id, ())))

    def _update_block_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else self.hash_salt
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hash((parent, tuple(request.tokens_slice(i * bs, (i + 1) * bs))))
            hashes.append(parent)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of a request that holds no blocks yet, in whole blocks."""
        if not self.enable_prefix_caching or request.request_id in self.tables:
            return [], 0
        self._update_block_hashes(request)
        bs = self.block_size
        hits: list[KVBlock] = []
        for i, h in enumerate(request.block_hashes):
            block = self.device.lookup(h, tuple(request.tokens_slice(i * bs, (i + 1) * bs)))
            if block is None:
                break
            hits.append(block)
        # The last token must be computed to produce logits, so a full hit backs off one block.
        if hits and len(hits) * bs >= request.num_tokens:
            hits.pop()
        return hits, len(hits) * bs

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Grow the request's table to hold its computed tokens plus `num_new_tokens` more.
        `computed_blocks` (from get_computed_blocks) are attached first. False if it doesn't fit;
        nothing changes in that case."""
        computed_blocks = computed_blocks or []
        table = self.tables.get(request.request_id, [])
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = cdiv(total, self.block_size) - len(table) - len(computed_blocks)
        # Cached hits sitting in the free list stop being free once we take them.
        hits_in_free = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.device.num_free_blocks - hits_in_free:
            return False
        self.device.touch(computed_blocks)
        table = table + computed_blocks + (self.device.allocate(need) if need > 0 else [])
        self.tables[request.request_id] = table
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the blocks whose every token is now computed (call after num_computed advances)."""
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(request.request_id)
        if not table:
            return
        n_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered.get(request.request_id, 0)
        if n_full <= start:
            return
        self._update_block_hashes(request)
        bs = self.block_size
        for i in range(start, n_full):
            self.device.register(table[i], request.block_hashes[i],
                                 tuple(request.tokens_slice(i * bs, (i + 1) * bs)))
        self._num_registered[request.request_id] = n_full

    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self.tables.pop(rid, None)
        if table:
            self.device.free(list(reversed(table)))
        host_table = self.host_tables.pop(rid, None)
        if host_table and self.host is not None:
            self.host.free(host_table)
        self._num_registered.pop(rid, None)

    # ---- swapping ------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return self.host is not None and len(self.tables.get(request.request_id, ())) <= self.host.num_free_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move a request's device blocks to host blocks; returns (device_id, host_id) copies."""
        assert self.host is not None, "swap needs a host block pool"
        rid = request.request_id
        table = self.tables.pop(rid, [])
        host_blocks = self.host.allocate(len(table))
        self.host_tables[rid] = host_blocks
        mapping = [(d.block_id, h.block_id) for d, h in zip(table, host_blocks)]
        self.device.free(list(reversed(table)))
        self._num_registered.pop(rid, None)
        return mapping

    def can_swap_in(self, request: Request) -> bool:
        return len(self.host_tables.get(request.request_id, ())) <= self.device.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request back; returns (host_id, device_id) copies."""
        assert self.host is not None
        rid = request.request_id
        host_blocks = self.host_tables.pop(rid, [])
        device_blocks = self.device.allocate(len(host_blocks))
        self.tables[rid] = device_blocks
        mapping = [(h.block_id, d.block_id) for h, d in zip(host_blocks, device_blocks)]
        self.host.free(host_blocks)
        return mapping

    # ---- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        refs = Counter(b.block_id for table in self.tables.values() for b in table)
        for rid, table in self.tables.items():
            assert len({b.block_id for b in table}) == len(table), f"request {rid} holds a block twice"
        self.device.check_invariants(refs)
        if self.host is not None:
            host_refs = Counter(b.block_id for t in self.host_tables.values() for b in t)
            assert all(v == 1 for v in host_refs.values()), "a host block is owned by two requests"
            self.host.check_invariants(host_refs)
        else:
            assert not self.host_tables

    def num_held_blocks(self) -> int:
        return sum(len(t) for t in self.tables.values())
