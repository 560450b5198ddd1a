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
        # Device blocks being copied out during the current step: the copy overlaps the forward
        # pass, so they return to the pool only at the next step (release_swapped_out()).
        self._swapping_out: list[KVBlock] = []

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
        parent = hashes[-1] if hashes else hash((self.hash_salt, request.cache_salt))
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
        if not table or request.request_id in self.host_tables:
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

    # ---- swapping and discarding ---------------------------------------------------------
    # A request's context is split as host blocks for block indices [0, k) and device blocks for
    # [k, n). Swap-out moves the front device block to the end of the host part; swap-in moves
    # the last host block to the front of the device part. Either can stop after any block, so
    # a context moves in budgeted chunks across steps, and discarding the device part leaves a
    # prefix on the host that swap-in restores before recompute continues after it.
    def num_device_blocks_of(self, request_id: str) -> int:
        return len(self.tables.get(request_id, ()))

    def num_host_blocks_of(self, request_id: str) -> int:
        return len(self.host_tables.get(request_id, ()))

    def swap_out_blocks(self, request: Request, max_blocks: int) -> list[tuple[int, int]]:
        """Move up to max_blocks of the request's device blocks to the host; (device, host) copies."""
        if self.host is None or max_blocks <= 0:
            return []
        rid = request.request_id
        table = self.tables.get(rid, [])
        n = min(max_blocks, len(table), self.host.num_free_blocks)
        if n == 0:
            return []
        moving, self.tables[rid] = table[:n], table[n:]
        host_blocks = self.host.allocate(n)
        self.host_tables.setdefault(rid, []).extend(host_blocks)
        self._swapping_out.extend(reversed(moving))
        self._num_registered.pop(rid, None)
        return [(d.block_id, h.block_id) for d, h in zip(moving, host_blocks)]

    def release_swapped_out(self) -> None:
        """The previous step's copies are done: their source blocks may be reused."""
        if self._swapping_out:
            self.device.free(self._swapping_out)
            self._swapping_out = []

    def swap_in_blocks(self, request: Request, max_blocks: int) -> list[tuple[int, int]]:
        """Bring up to max_blocks host blocks back to the device; (host, device) copies."""
        rid = request.request_id
        host_table = self.host_tables.get(rid, [])
        n = min(max_blocks, len(host_table), self.device.num_free_blocks)
        if n <= 0 or self.host is None:
            return []
        moving = host_table[len(host_table) - n:]
        del host_table[len(host_table) - n:]
        if not host_table:
            del self.host_tables[rid]
        device_blocks = self.device.allocate(n)
        self.tables[rid] = device_blocks + self.tables.get(rid, [])
        self.host.free(moving)
        return [(h.block_id, d.block_id) for h, d in zip(moving, device_blocks)]

    def discard_device_blocks(self, request: Request) -> None:
        """Free the device part of a paused context; a host prefix, if any, is kept."""
        table = self.tables.pop(request.request_id, None)
        if table:
            self.device.free(list(reversed(table)))
        self._num_registered.pop(request.request_id, None)
        request.num_computed_tokens = min(request.num_computed_tokens,
                                          self.num_host_blocks_of(request.request_id) * self.block_size)

    # ---- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        refs = Counter(b.block_id for table in self.tables.values() for b in table)
        refs.update(b.block_id for b in self._swapping_out)
        for rid in self.host_tables:
            assert self.host_tables[rid], f"request {rid} has an empty host table"
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
