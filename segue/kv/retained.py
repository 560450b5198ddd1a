"""A context kept on the device after its request finished: the history of an agent whose next
turn is expected after a tool call (Continuum's pinned KV). The handle holds one reference on
each of its cached blocks, so they are neither free nor evictable until it is released; a later
request that extends the context finds them through the prefix cache like any cached block."""
from __future__ import annotations

from dataclasses import dataclass

from segue.kv.block_pool import KVBlock


@dataclass(eq=False)
class RetainedContext:
    # Full, cached blocks of the finished request's context, head first, one reference each.
    blocks: list[KVBlock]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def num_private_blocks(self) -> int:
        """Blocks that releasing the handle frees: those no running request or other handle holds
        (a shared system prompt stays). References grow toward the head, so they are a suffix."""
        n = 0
        while n < len(self.blocks) and self.blocks[len(self.blocks) - 1 - n].ref_cnt == 1:
            n += 1
        return n
