"""A context kept on the device after its request finished: the history of an agent whose next
turn is expected after a tool call (Continuum's pinned KV). The handle holds one reference on
each of its cached blocks, so they are neither free nor evictable until it is released; a later
request that extends the context finds them through the prefix cache like any cached block."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from segue.kv.block_pool import BlockPool, KVBlock
from segue.kv.interface import RetainedContext


class RetainedContexts:
    """The live handles of one device pool (KVCacheManager.retain): a released or unknown handle
    is ignored, so that releasing twice frees nothing twice."""

    def __init__(self, device: BlockPool) -> None:
        self.device = device
        self._handles: dict[int, RetainedContext] = {}

    def hold(self, blocks: list[KVBlock]) -> RetainedContext:
        handle = RetainedContext(blocks)
        self._handles[id(handle)] = handle
        return handle

    def release(self, handle: RetainedContext) -> int:
        """Free the handle's blocks into the prefix cache; returns the device blocks freed."""
        if self._handles.pop(id(handle), None) is None:
            return 0
        before = self.device.num_free_blocks
        self.device.free(list(reversed(handle.blocks)))
        handle.blocks = []
        return self.device.num_free_blocks - before

    def num_private_blocks(self) -> int:
        """Device blocks only retained handles hold: what releasing every one would free (a system
        prompt two histories share counts once; one a running request shares, not at all)."""
        refs = Counter(b.block_id for h in self._handles.values() for b in h.blocks)
        return sum(1 for bid, n in refs.items() if self.device.blocks[bid].ref_cnt == n)

    def blocks(self) -> Iterator[KVBlock]:
        """Every block a handle holds, one per reference."""
        for handle in self._handles.values():
            yield from handle.blocks
