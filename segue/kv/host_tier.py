"""The host tier: a second block pool that holds swapped-out contexts and, through the prefix
cache, blocks evicted from the device (SGLang's HiCache write-back, ANCHORS.md §1), with the
copies between the two tiers budgeted per step by one host link.

Owned by KVCacheManager (segue/kv/manager.py), which hands it the device pool and tables it moves
blocks between; a manager without host memory has no HostTier at all.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from segue.kv.block_pool import BlockPool, KVBlock, num_private_tail
from segue.kv.hashing import BlockHasher
from segue.kv.interface import Copies
from segue.request import Request


@dataclass
class HostLink:
    """The host link's budget for the current step, in blocks: swap-ins, swap-outs and write-backs
    all draw from it, so together they copy no more than hides behind the step's compute. Kept
    apart from the tier because a manager without host memory still opens and closes it."""
    budget: int = 0
    # Write-backs wait until the swaps planned first have taken their share.
    write_backs_open: bool = False
    # Past the budget a write-back stalls the step for its copy; the scheduler allows that when
    # the recompute it saves is worth more (CostModel.copy_pays, on the tier's measured reuse).
    write_backs_past_budget: bool = False

    def open(self, blocks: int) -> None:
        self.budget = blocks
        self.write_backs_open = False
        self.write_backs_past_budget = False

    def close(self) -> None:
        self.budget = 0
        self.write_backs_open = False
        self.write_backs_past_budget = False


@dataclass
class WriteBackOutcomes:
    """What became of the blocks written back to the host tier: read back by a later request's
    host hits, or evicted from the host unread. Their ratio is the measured chance that writing
    an evicted block back saves its recompute."""
    read: int = 0
    evicted_unread: int = 0
    # Host blocks written back and not read since; the tier's size bounds it.
    unread: set[int] = field(default_factory=set)

    def reuse_rate(self) -> float:
        """Laplace-smoothed: 1/2 before any outcome, as for a block nothing is known about."""
        return (self.read + 1) / (self.read + self.evicted_unread + 2)

    def on_read(self, blocks: list[KVBlock]) -> None:
        for b in blocks:
            if b.block_id in self.unread:
                self.unread.discard(b.block_id)
                self.read += 1

    def on_evict(self, block: KVBlock) -> None:
        if block.block_id in self.unread:
            self.unread.discard(block.block_id)
            self.evicted_unread += 1


class HostTier:
    def __init__(self, pool: BlockPool, device: BlockPool, device_tables: dict[str, list[KVBlock]],
                 num_registered: dict[str, int], hasher: BlockHasher, link: HostLink,
                 enable_prefix_caching: bool) -> None:
        self.pool = pool
        # The manager's, shared: a move between the tiers changes both tables at once.
        self.device = device
        self.device_tables = device_tables
        self.num_registered = num_registered
        self.hasher = hasher
        self.link = link
        self.enable_prefix_caching = enable_prefix_caching
        # A request's context: device blocks for block indices [0, d), then these for [d, n).
        self.tables: dict[str, list[KVBlock]] = {}
        # Device blocks being copied out during the current step: the copy overlaps the forward
        # pass, so they return to the pool only at the next step (release_swapped_out()).
        self.swapping_out: list[KVBlock] = []
        # Host blocks being written this step: published only once the copy is done.
        self._pending: list[tuple[KVBlock, int, tuple[int, ...]]] = []
        # Host blocks that this step's copies read (swap-ins) or write (swap-outs) and that their
        # owner let go of: free only from the next step, so that no other copy of this step
        # (write-backs run first, swap-outs last) lands on one out of order.
        self._deferred: list[KVBlock] = []
        self._writing: set[int] = set()
        self._back_ups: Copies = []
        self._backed_up: list[KVBlock] = []
        # The device eviction key of each written-back block (None: plain LRU), kept in the host tier.
        self._backed_up_keys: list[float | None] = []
        # Set when finished requests' blocks are freed with eviction keys (prefix_eviction="reuse"):
        # host blocks read back are then keyed too, so that one order covers the whole tier.
        self.keyed_reloads = False
        self.write_backs = WriteBackOutcomes()
        self.num_stalled_write_backs = 0
        if enable_prefix_caching:
            device.on_evict = self._back_up
            pool.on_evict = self.write_backs.on_evict

    # ---- swapping ------------------------------------------------------------------------
    # Swap-out moves the private tail of the device part to the front of the host part; swap-in
    # moves the front of the host part to the end of the device part. Either can stop after any
    # block, so a context moves in budgeted chunks across steps. Shared blocks never move: they
    # free nothing, and a later swap-in would duplicate what the device still holds.
    def swap_out(self, request: Request, max_blocks: int) -> Copies:
        """A block whose content the host tier already holds is not copied."""
        if max_blocks <= 0:
            return []
        rid = request.request_id
        table = self.device_tables.get(rid, [])
        n = min(max_blocks, num_private_tail(table), self.pool.num_free_blocks)
        if n <= 0:
            return []
        start = len(table) - n
        moving = table[start:]
        full = request.num_computed_tokens // self.hasher.block_size
        if self.enable_prefix_caching:
            self.hasher.update(request)
        copies: Copies = []
        host_blocks = []
        for i, dev in enumerate(moving, start):
            key = self.hasher.key(request, i) if self.enable_prefix_caching and i < full else None
            hb = self.pool.lookup(*key) if key is not None else None
            if hb is not None:
                self.pool.touch([hb])
            else:
                hb = self.pool.allocate(1)[0]
                copies.append((dev.block_id, hb.block_id))
                self._writing.add(hb.block_id)
                if key is not None:
                    self._pending.append((hb, *key))
            host_blocks.append(hb)
        if start:
            self.device_tables[rid] = table[:start]
        else:
            del self.device_tables[rid]
        self.tables[rid] = host_blocks + self.tables.get(rid, [])
        self.swapping_out.extend(reversed(moving))
        self.num_registered[rid] = min(self.num_registered.get(rid, 0), start)
        self.link.budget -= len(copies)
        return copies

    def swap_in(self, request: Request, max_blocks: int) -> Copies:
        """A block the device cache still holds is shared instead of copied (and costs no copy),
        so a step either copies something or moves the whole host part."""
        rid = request.request_id
        host_table = self.tables.get(rid, [])
        if not host_table or max_blocks <= 0:
            return []
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
        n = len(new_blocks)
        if n == 0:
            return []
        moving = host_table[:n]
        del host_table[:n]
        if not host_table:
            del self.tables[rid]
        self.device_tables[rid] = self.device_tables.get(rid, []) + new_blocks
        self._deferred.extend(reversed(moving))
        return copies

    def release_swapped_out(self) -> None:
        """The previous step's copies are done: their source blocks may be reused, and the host
        copies become findable (a block freed since then is left out: its slot may be reused)."""
        if self.swapping_out:
            self.device.free(self.swapping_out)
            self.swapping_out = []
        written = {b.block_id for b in self._backed_up}
        for block, block_hash, token_ids in self._pending:
            if block.ref_cnt > 0:
                self.pool.register(block, block_hash, token_ids)
                if block.block_id in written:
                    self.write_backs.unread.add(block.block_id)
        self._pending = []
        if self._backed_up:
            # Now cached in the host tier, owned by no one; a block evicted with an expected reuse
            # keeps it there, so both tiers evict in the same order.
            plain = [b for b, k in zip(self._backed_up, self._backed_up_keys, strict=True) if k is None]
            hinted = [(b, k) for b, k in zip(self._backed_up, self._backed_up_keys, strict=True) if k is not None]
            if plain:
                self.pool.free(plain)
            if hinted:
                self.pool.free([b for b, _ in hinted], [k for _, k in hinted])
            self._backed_up = []
            self._backed_up_keys = []
        self._writing.clear()
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            if not self.keyed_reloads:
                self.free(deferred)
                return
            # Under keyed eviction, a host block just read back (a swap-in) was used now: keyed as
            # if freed now. Left unkeyed it would be evicted before every keyed block, so the
            # host tier would drop its hottest blocks first.
            self.free(deferred, [self.pool.now] * len(deferred))

    # ---- write-back ----------------------------------------------------------------------
    def _back_up(self, block: KVBlock) -> None:
        """The device pool's eviction hook: copy a cached block about to be reused to the host
        tier, within the link budget left (or past it where the scheduler allowed that), unless
        the host tier already holds its content."""
        if not self.link.write_backs_open:
            return
        if self.link.budget <= 0 and not self.link.write_backs_past_budget:
            return
        # Only cached blocks are evicted through this hook: they carry their key.
        assert block.block_hash is not None and block.token_ids is not None
        copy = self.pool.lookup(block.block_hash, block.token_ids)
        if copy is not None:
            if self.keyed_reloads and block.reuse_at is not None:
                self.pool.rekey(copy, block.reuse_at)  # the host copy now stands for the block
            return
        if not self.pool.num_free_blocks:
            return
        hb = self.pool.allocate(1)[0]
        if self.link.budget <= 0:
            self.num_stalled_write_backs += 1
        # Past the budget too: the copies planned after it must not spend what it took.
        self.link.budget -= 1
        self._back_ups.append((block.block_id, hb.block_id))
        self._pending.append((hb, block.block_hash, block.token_ids))
        self._backed_up.append(hb)
        self._backed_up_keys.append(block.reuse_at)

    def take_back_ups(self) -> Copies:
        out, self._back_ups = self._back_ups, []
        return out

    # ---- host tables ---------------------------------------------------------------------
    def lookup_hits(self, request: Request, start: int) -> list[KVBlock]:
        """Cached host blocks that continue a request's chain from block `start`."""
        bs = self.hasher.block_size
        hits: list[KVBlock] = []
        for i in range(start, len(request.block_hashes)):
            if (i + 1) * bs >= request.num_tokens:
                break  # the last token is always computed
            block = self.pool.lookup(*self.hasher.key(request, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def attach(self, request_id: str, hits: list[KVBlock]) -> None:
        self.pool.touch(hits)
        self.write_backs.on_read(hits)
        self.tables[request_id] = list(hits)

    def free(self, blocks: list[KVBlock], reuse_at: list[float] | None = None) -> None:
        """Drop one reference each (tail first, as BlockPool.free)."""
        if self._writing:
            # Written this step and let go: never published, and free only from the next step.
            late = [b for b in blocks if b.ref_cnt == 1 and b.block_id in self._writing]
            if late:
                ids = {b.block_id for b in late}
                self._pending = [p for p in self._pending if p[0].block_id not in ids]
                self._deferred.extend(late)
                keep = [i for i, b in enumerate(blocks) if b.block_id not in ids]
                blocks = [blocks[i] for i in keep]
                reuse_at = [reuse_at[i] for i in keep] if reuse_at is not None else None
        self.pool.free(blocks, reuse_at)

    def check_invariants(self) -> None:
        for rid, table in self.tables.items():
            assert table, f"request {rid} has an empty host table"
            assert len({b.block_id for b in table}) == len(table), f"request {rid} holds a host block twice"
        refs = Counter(b.block_id for t in self.tables.values() for b in t)
        refs.update(b.block_id for b in self._deferred + self._backed_up)
        self.pool.check_invariants(refs)
        pending = [b.block_id for b, _, _ in self._pending]
        assert len(set(pending)) == len(pending), "a host block is written twice in one step"
