"""The device side of KVCacheManager (segue/kv/manager.py): the device pool, each request's device
block table (head first) and how much of it is published in the prefix cache. The manager
composes it beside the host side (segue/kv/host_side.py) and moves blocks between the two
through the verbs below; neither holds the other's tables.
"""
from __future__ import annotations

from collections import Counter

from segue.arith import cdiv
from segue.kv.block_pool import BlockPool, KVBlock, num_private_tail, release_keys
from segue.kv.hashing import BlockHasher
from segue.kv.interface import PrefixHit, RetainedContext
from segue.request import Request


class DeviceTables:
    def __init__(self, pool: BlockPool, hasher: BlockHasher, enable_prefix_caching: bool) -> None:
        self.pool = pool
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.enable_prefix_caching = enable_prefix_caching
        # A request's device blocks, head first; the host tier holds the rest of its context.
        self.tables: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are already published in the prefix cache.
        self._num_registered: dict[str, int] = {}

    # ---- queries -------------------------------------------------------------------------
    def num_blocks_of(self, request_id: str) -> int:
        return len(self.tables.get(request_id, ()))

    def holders(self) -> list[str]:
        return [rid for rid, table in self.tables.items() if table]

    def num_held_blocks(self) -> int:
        """Device blocks in requests' tables (counted once per table that holds them)."""
        return sum(len(t) for t in self.tables.values())

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(self.tables.get(request.request_id, ())))

    def num_private_blocks_of(self, request_id: str) -> int:
        return num_private_tail(self.tables.get(request_id, []))

    def num_registered(self, request_id: str) -> int:
        return self._num_registered.get(request_id, 0)

    def num_freed_by_release(self, request_ids: list[str], handles: list[RetainedContext],
                             hit: PrefixHit) -> int:
        """See KVCacheManager.num_freed_by_release."""
        refs = Counter(b.block_id for rid in request_ids for b in self.tables.get(rid, ()))
        refs.update(b.block_id for h in handles for b in h.blocks)
        taken = set(hit.block_ids)
        return sum(1 for bid, n in refs.items() if self.pool.blocks[bid].ref_cnt == n and bid not in taken)

    # ---- prefix cache --------------------------------------------------------------------
    def match(self, request: Request) -> PrefixHit:
        """Longest device-cached prefix of a request, in whole blocks."""
        self.hasher.update(request)
        hits: list[KVBlock] = []
        for i in range(len(request.block_hashes)):
            block = self.pool.lookup(*self.hasher.key(request, i))
            if block is None:
                break
            hits.append(block)
        # The last token must be computed to produce logits, so a full hit backs off one block.
        if hits and len(hits) * self.block_size >= request.num_tokens:
            hits.pop()
        return PrefixHit(tuple(hits), (), self.block_size)

    def publish(self, request: Request) -> None:
        """Register the request's blocks whose every token is computed in the prefix cache."""
        table = self.tables.get(request.request_id)
        if not table:
            return
        n_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered.get(request.request_id, 0)
        if n_full <= start:
            return
        self.hasher.update(request)
        for i in range(start, n_full):
            self.pool.register(table[i], *self.hasher.key(request, i))
        self._num_registered[request.request_id] = n_full

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int, hits: list[KVBlock], num_free_hits: int) -> bool:
        """Grow the table by `hits` (cached blocks, `num_free_hits` of them in the free list) and
        fresh blocks for `num_new_tokens` more tokens; False, changing nothing, if it doesn't fit."""
        table = self.tables.get(request.request_id, [])
        total = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        need = cdiv(total, self.block_size) - len(table) - len(hits)
        # Cached hits sitting in the free list stop being free once we take them.
        if need > self.pool.num_free_blocks - num_free_hits:
            return False
        self.pool.touch(hits)
        table = table + hits + (self.pool.allocate(need) if need > 0 else [])
        self.tables[request.request_id] = table
        return True

    def attach(self, request_id: str, hits: list[KVBlock]) -> None:
        """Take cached device blocks as a request's table (its host part follows them)."""
        self.pool.touch(hits)
        if hits:
            self.tables[request_id] = list(hits)
        self._num_registered[request_id] = len(hits)

    def extend(self, request_id: str, blocks: list[KVBlock]) -> None:
        """Swap-in: blocks brought from the host continue the table."""
        if blocks:
            self.tables[request_id] = self.tables.get(request_id, []) + blocks

    def cut_tail(self, request_id: str, n: int) -> None:
        """Swap-out: the table's last `n` blocks left for the host (the host side frees them)."""
        if not n:
            return
        table = self.tables[request_id]
        start = len(table) - n
        if start:
            self.tables[request_id] = table[:start]
        else:
            del self.tables[request_id]
        self._num_registered[request_id] = min(self._num_registered.get(request_id, 0), start)

    # ---- giving blocks back --------------------------------------------------------------
    def free(self, request_id: str, reuse_at: list[float] | None = None) -> None:
        """Drop the table (keys head first, or None); cached blocks stay findable until evicted."""
        table = self.tables.pop(request_id, None)
        if table:
            if reuse_at is not None and len(reuse_at) != len(table):
                raise ValueError(f"request {request_id}: {len(reuse_at)} eviction keys for {len(table)} blocks")
            self.pool.free(list(reversed(table)), list(reversed(reuse_at)) if reuse_at is not None else None)

    def release(self, request_id: str, reuse_at: float | None, block_recompute_s: float) -> None:
        """Drop the table, keyed as by release_keys (KVCacheManager.release)."""
        table = self.tables.pop(request_id, None)
        if table:
            self.pool.free(list(reversed(table)), release_keys(len(table), reuse_at, block_recompute_s))

    def forget(self, request_id: str) -> None:
        self._num_registered.pop(request_id, None)

    def truncate(self, request_id: str, keep: int) -> None:
        """Keep the table's first `keep` blocks; published ones after them stay findable."""
        device = self.tables.get(request_id, [])
        if device[keep:]:
            self.pool.free(list(reversed(device[keep:])))
            if keep:
                self.tables[request_id] = device[:keep]
            else:
                del self.tables[request_id]
        if request_id in self._num_registered:
            self._num_registered[request_id] = min(self._num_registered[request_id], keep)

    def detach_published(self, request_id: str) -> list[KVBlock]:
        """Take the table's published head away (the caller holds it) and free the rest."""
        n = self._num_registered.pop(request_id, 0)
        table = self.tables.pop(request_id)
        self.pool.free(list(reversed(table[n:])))
        return table[:n]

    def check_invariants(self, refs: Counter[int]) -> None:
        """`refs`: references held outside the tables (copies in flight, retained contexts)."""
        refs.update(b.block_id for table in self.tables.values() for b in table)
        for rid, table in self.tables.items():
            assert table, f"request {rid} has an empty device table"
            assert len({b.block_id for b in table}) == len(table), f"request {rid} holds a block twice"
        self.pool.check_invariants(refs)
