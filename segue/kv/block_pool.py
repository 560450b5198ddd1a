"""A pool of fixed-size KV blocks with reference counts and a prefix cache.

Free blocks live in one LRU-ordered dict: blocks that still carry a prefix-cache hash stay
findable until they are reused, and the least recently freed block is reused first, so a hot
prefix survives while cold ones make room.
"""
from __future__ import annotations

from collections import OrderedDict
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


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, name: str = "device") -> None:
        if num_blocks < 1:
            raise ValueError(f"{name} block pool needs at least one block, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"{self.name} pool: asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each. Callers pass a table tail-first so that a sequence's last
        blocks, the least likely to be shared, are the first to be reused."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise AssertionError(f"{self.name} block {block.block_id} freed twice")
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def register(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Publish a full block in the prefix cache (first writer wins for a given hash)."""
        if not self.enable_caching or block.block_hash is not None:
            return
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
            self._evict_hash(block)

    def check_invariants(self, expected_refs: dict[int, int]) -> None:
        """expected_refs: block_id -> number of block tables holding it."""
        for block in self.blocks:
            want = expected_refs.get(block.block_id, 0)
            assert block.ref_cnt == want, (
                f"{self.name} block {block.block_id}: ref_cnt {block.ref_cnt} but held by {want} tables")
            assert (block.ref_cnt == 0) == (block.block_id in self._free), (
                f"{self.name} block {block.block_id}: ref_cnt {block.ref_cnt} disagrees with the free list")
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, f"{self.name} block {block.block_id}: stale hash"
        for h, block in self._cached.items():
            assert block.block_hash == h, f"{self.name} prefix cache entry {h} points at a re-hashed block"
        assert len(self._free) + sum(1 for b in self.blocks if b.ref_cnt > 0) == self.num_blocks
