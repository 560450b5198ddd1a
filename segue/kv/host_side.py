"""The host side of KVCacheManager (segue/kv/manager.py): the host link that budgets each step's
copies, the device blocks whose copy to the host is in flight, and the host tier when there is
host memory (without one every query reads 0 and nothing moves).

Composed by the manager, which owns the device block tables: a swap is handed the request's
device table and returns what changed, so no table is shared between the two.
"""
from __future__ import annotations

from segue.kv.block_pool import BlockPool, KVBlock, num_private_tail, release_keys
from segue.kv.hashing import BlockHasher
from segue.kv.host_link import HostLink
from segue.kv.host_tier import HostTier
from segue.kv.interface import Copies
from segue.request import Request


class HostSide:
    def __init__(self, device: BlockPool, num_host_blocks: int, hasher: BlockHasher,
                 enable_prefix_caching: bool) -> None:
        self.device = device
        # The scheduler opens the link each step (open_link) and take_back_ups() closes it.
        self.link = HostLink()
        # Device blocks being copied out during the current step: the copy overlaps the forward
        # pass, so they return to the pool only at the next step (release_swapped_out()).
        self.swapping_out: list[KVBlock] = []
        self.tier: HostTier | None = None
        if num_host_blocks > 0:
            self.tier = HostTier(BlockPool(num_host_blocks, enable_prefix_caching, "host"), hasher,
                                 enable_prefix_caching)
            if enable_prefix_caching:
                device.on_evict = self._back_up

    # ---- queries (all 0 without a tier) -------------------------------------------------
    @property
    def pool(self) -> BlockPool | None:
        return self.tier.pool if self.tier is not None else None

    @property
    def tables(self) -> dict[str, list[KVBlock]]:
        """Each request's host blocks, which continue its device table (empty without a host tier)."""
        return self.tier.tables if self.tier is not None else {}

    def num_blocks_of(self, request_id: str) -> int:
        return self.tier.num_blocks_of(request_id) if self.tier is not None else 0

    def write_back_reuse_rate(self) -> float:
        return self.tier.write_backs.reuse_rate() if self.tier is not None else 0.0

    @property
    def num_stalled_write_backs(self) -> int:
        return self.tier.num_stalled_write_backs if self.tier is not None else 0

    # ---- a request's host part ----------------------------------------------------------
    def lookup_hits(self, request: Request, start: int) -> list[KVBlock]:
        return self.tier.lookup_hits(request, start) if self.tier is not None else []

    def attach(self, request_id: str, hits: list[KVBlock]) -> None:
        assert self.tier is not None, "host hits without a host tier"
        self.tier.attach(request_id, hits)

    def free(self, request_id: str, reuse_at: float | None = None, block_recompute_s: float = 0.0) -> None:
        """Free a request's host part (keyed as by release_keys)."""
        table = self.tier.pop_table(request_id) if self.tier is not None else None
        if table:
            assert self.tier is not None
            self.tier.free(list(reversed(table)), release_keys(len(table), reuse_at, block_recompute_s))

    def truncate(self, request_id: str, keep: int) -> None:
        if self.tier is not None:
            self.tier.truncate(request_id, keep)

    # ---- swapping -----------------------------------------------------------------------
    # Swap-out moves the private tail of the device part to the front of the host part; swap-in
    # moves the front of the host part to the end of the device part. Either can stop after any
    # block, so a context moves in budgeted chunks across steps. Shared blocks never move: they
    # free nothing, and a later swap-in would duplicate what the device still holds.
    def swap_out(self, request: Request, table: list[KVBlock], max_blocks: int) -> tuple[Copies, int]:
        """Move up to max_blocks of `table`'s (the request's device part's) private tail to the
        host; returns the (device, host) copies and how many blocks left the table's end."""
        if self.tier is None or max_blocks <= 0:
            return [], 0
        n = min(max_blocks, num_private_tail(table), self.tier.pool.num_free_blocks)
        if n <= 0:
            return [], 0
        moving = table[len(table) - n:]
        copies = self.tier.store(request, moving, len(table) - n)
        self.swapping_out.extend(reversed(moving))
        self.link.budget -= len(copies)
        return copies, n

    def swap_in(self, request: Request, max_blocks: int) -> tuple[Copies, list[KVBlock]]:
        """Bring the front of the request's host part to the device, up to max_blocks copies;
        returns the (host, device) copies and the device blocks that continue its device table.
        A block the device cache still holds is shared instead of copied (and costs no copy), so
        a step either copies something or moves the whole host part."""
        host_table = self.tier.tables.get(request.request_id, []) if self.tier is not None else []
        if not host_table or max_blocks <= 0:
            return [], []
        assert self.tier is not None
        copies: Copies = []
        new_blocks = []
        # The swap-in claims its copies from the link before it allocates: a cached block that an
        # allocation evicts is written back only within what is left after them. The part it
        # does not use is given back below.
        self.link.budget -= max_blocks
        for hb in host_table:
            dev = None
            if hb.block_hash is not None and hb.token_ids is not None:
                dev = self.device.lookup(hb.block_hash, hb.token_ids)
            if dev is not None:
                self.device.touch([dev])
            elif len(copies) < max_blocks and self.device.num_free_blocks:
                dev = self.device.allocate(1)[0]
                copies.append((hb.block_id, dev.block_id))
            else:
                break
            new_blocks.append(dev)
        self.link.budget += max_blocks - len(copies)
        if new_blocks:
            self.tier.drop_front(request.request_id, len(new_blocks))
        return copies, new_blocks

    def release_swapped_out(self) -> None:
        """The previous step's copies are done: their source blocks may be reused, and the host
        copies become findable (HostTier.release_step)."""
        if self.swapping_out:
            self.device.free(self.swapping_out)
            self.swapping_out = []
        if self.tier is not None:
            self.tier.release_step()

    # ---- write-back ----------------------------------------------------------------------
    def _back_up(self, block: KVBlock) -> None:
        """The device pool's eviction hook: copy a cached block about to be reused to the host
        tier, within the link budget left (or past it where the scheduler allowed that)."""
        link = self.link
        if not link.write_backs_open:
            return
        if link.budget <= 0 and not link.write_backs_past_budget:
            return
        assert self.tier is not None
        # Past the budget too: the copies planned after it must not spend what it took.
        if self.tier.write_back(block, stalled=link.budget <= 0):
            link.budget -= 1

    def take_back_ups(self) -> Copies:
        """This step's write-back copies (device, host); the link budget ends with the step."""
        out = self.tier.take_back_ups() if self.tier is not None else []
        self.link.close()
        return out

    def check_invariants(self) -> None:
        if self.tier is not None:
            self.tier.check_invariants()
