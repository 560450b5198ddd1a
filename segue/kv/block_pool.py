"""A pool of fixed-size KV blocks with reference counts and a prefix cache.

A free block that still carries a prefix-cache hash stays findable until it is reused (a hit
revives it), so the order in which free blocks are reused is the cache's eviction order:

1. blocks without a hash (nothing to lose);
2. blocks released for a paused request that nobody is expected to continue (abandoned);
3. blocks of finished or preempted requests, least recently freed first (plain LRU: their reuse
   is speculative);
4. blocks released for a paused request that is expected back, the furthest expected reuse first
   (Continuum's TTL as a score). The caller lowers a block's key by what losing it would cost in
   recompute (InferCept's waste), so a context's head outlives its tail.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache.
    block_hash: int | None = None
    # The block's tokens, kept to reject hash collisions on lookup.
    token_ids: tuple[int, ...] | None = None
    # While free: the expected time of its next use (None: no hint, plain LRU).
    reuse_at: float | None = None
    heap_seq: int = 0


def num_private_tail(blocks: list[KVBlock]) -> int:
    """How many blocks at the end of a table no other holder shares: what letting it go frees.
    References only grow toward the head (a prefix hit takes every block before the one it
    shares), so the private blocks are a suffix."""
    n = 0
    while n < len(blocks) and blocks[len(blocks) - 1 - n].ref_cnt == 1:
        n += 1
    return n


def release_keys(n: int, reuse_at: float | None, block_recompute_s: float) -> list[float] | None:
    """Eviction keys, tail first, for a table of `n` blocks released together (KVCacheManager.release):
    block i's key is `reuse_at` lowered by (n - i) * `block_recompute_s`, so the head outlives the tail."""
    if reuse_at is None:
        return None
    keys = [reuse_at - (n - i) * block_recompute_s for i in range(n)]
    keys.reverse()
    return keys


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, name: str = "device") -> None:
        if num_blocks < 1:
            raise ValueError(f"{name} block pool needs at least one block, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._lru: OrderedDict[int, KVBlock] = OrderedDict()
        self._hinted: dict[int, KVBlock] = {}
        # (-reuse_at, seq, block_id): the furthest expected reuse on top, and (reuse_at, seq,
        # block_id): the most overdue on top; stale entries are skipped.
        self._heap: list[tuple[float, int, int]] = []
        self._overdue: list[tuple[float, int, int]] = []
        # The clock, set each step: a block whose expected reuse has passed by x is expected x
        # later still (InferCept's dynamic estimate), so a held turn nobody continues decays.
        self.now = 0.0
        self._seq = 0
        self._cached: dict[int, KVBlock] = {}
        # Called with each cached block about to lose its hash to a reallocation (write-back).
        self.on_evict: Callable[[KVBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._lru) + len(self._hinted)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that a prefix hit could still revive."""
        return len(self._lru) + len(self._hinted)

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"{self.name} pool: asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self._pop_victim()
            if block.block_hash is not None and self.on_evict is not None:
                self.on_evict(block)
            self._evict_hash(block)
            block.ref_cnt = 1
            block.reuse_at = None  # a new life: the last one's key would be read by a write-back
            out.append(block)
        return out

    def _top(self, heap: list[tuple[float, int, int]]) -> KVBlock | None:
        while heap:
            _, seq, bid = heap[0]
            block = self.blocks[bid]
            if bid in self._hinted and block.heap_seq == seq:
                return block
            heapq.heappop(heap)
        return None

    def _pop_victim(self) -> KVBlock:
        if self._free:
            return self._free.popitem(last=False)[1]
        # Expected next use: reuse_at ahead, 2·now − reuse_at once overdue; its largest value is
        # at one of the two ends of the reuse_at order.
        latest, most_overdue = self._top(self._heap), self._top(self._overdue)
        top = latest
        # Both heaps index the same keyed blocks, so they are empty together; a keyed block has its key.
        if latest is not None and most_overdue is not None:
            assert latest.reuse_at is not None and most_overdue.reuse_at is not None
            if 2 * self.now - most_overdue.reuse_at > latest.reuse_at:
                top = most_overdue
        if top is not None and (top.reuse_at == math.inf or not self._lru):
            del self._hinted[top.block_id]
            return top
        return self._lru.popitem(last=False)[1]

    def _unfree(self, block: KVBlock) -> None:
        bid = block.block_id
        if self._free.pop(bid, None) is None and self._lru.pop(bid, None) is None:
            del self._hinted[bid]

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._unfree(block)
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock], reuse_at: list[float] | None = None) -> None:
        """Drop one reference each. Callers pass a table tail-first so that a sequence's last
        blocks, the least likely to be shared, are the first to be reused. `reuse_at` (one per
        block) is the expected time of each block's next use, for blocks kept for a paused
        request; without it, freed blocks are evicted least recently freed first."""
        for i, block in enumerate(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise AssertionError(f"{self.name} block {block.block_id} freed twice")
            if block.ref_cnt > 0:
                continue
            if block.block_hash is None:
                self._free[block.block_id] = block
            elif reuse_at is None:
                block.reuse_at = None
                self._lru[block.block_id] = block
            else:
                self._seq += 1
                block.reuse_at, block.heap_seq = reuse_at[i], self._seq
                self._hinted[block.block_id] = block
                heapq.heappush(self._heap, (-reuse_at[i], self._seq, block.block_id))
                heapq.heappush(self._overdue, (reuse_at[i], self._seq, block.block_id))
        if len(self._heap) > 2 * len(self._hinted) + 64:
            live = [e for e in self._heap if e[2] in self._hinted and self.blocks[e[2]].heap_seq == e[1]]
            self._heap = live
            self._overdue = [(-k, seq, bid) for k, seq, bid in live]
            heapq.heapify(self._heap)
            heapq.heapify(self._overdue)

    def rekey(self, block: KVBlock, reuse_at: float) -> None:
        """Give a free keyed block a new eviction key (a copy elsewhere was keyed since)."""
        if block.block_id not in self._hinted:
            return
        self._seq += 1
        block.reuse_at, block.heap_seq = reuse_at, self._seq
        heapq.heappush(self._heap, (-reuse_at, self._seq, block.block_id))
        heapq.heappush(self._overdue, (reuse_at, self._seq, block.block_id))

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def register(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Publish a held, full block in the prefix cache (first writer wins for a given hash)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        assert block.ref_cnt > 0, f"{self.name} block {block.block_id}: only held blocks are published"
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._cached[block_hash] = block

    def _evict_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            if block.ref_cnt == 0:
                self._unfree(block)
                self._free[block.block_id] = block
            self._evict_hash(block)

    def check_invariants(self, expected_refs: dict[int, int]) -> None:
        """expected_refs: block_id -> number of references (block tables, copies in flight)."""
        for block in self.blocks:
            bid = block.block_id
            want = expected_refs.get(bid, 0)
            assert block.ref_cnt == want, (
                f"{self.name} block {bid}: ref_cnt {block.ref_cnt} but held by {want} tables")
            places = (bid in self._free) + (bid in self._lru) + (bid in self._hinted)
            assert places == (block.ref_cnt == 0), (
                f"{self.name} block {bid}: ref_cnt {block.ref_cnt} disagrees with the free lists")
            if bid in self._free:
                assert block.block_hash is None, f"{self.name} block {bid}: a cached block among the hash-less"
            if bid in self._lru or bid in self._hinted:
                assert block.block_hash is not None, f"{self.name} block {bid}: a hash-less block among the cached"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, f"{self.name} block {bid}: stale hash"
        for h, block in self._cached.items():
            assert block.block_hash == h, f"{self.name} prefix cache entry {h} points at a re-hashed block"
