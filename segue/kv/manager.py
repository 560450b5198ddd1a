"""Per-request block tables over a device pool and a host pool, both indexed by the prefix cache.

The host pool is a second tier of the prefix cache (SGLang's HiCache, ANCHORS.md §1): a block
copied out keeps its hash there, so any request whose prefix continues past its device hits into
host-resident blocks loads them instead of recomputing them.
"""
from __future__ import annotations

from collections import Counter

from segue.kv.block_pool import BlockPool, KVBlock
from segue.kv.retained import RetainedContext
from segue.kv.swapping import SwapMixin
from segue.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager(SwapMixin):
    def __init__(self, block_size: int, num_device_blocks: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, hash_salt: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_salt = hash_salt
        self.device = BlockPool(num_device_blocks, enable_prefix_caching, "device")
        self.host = BlockPool(num_host_blocks, enable_prefix_caching, "host") if num_host_blocks > 0 else None
        # A request's context: device blocks for block indices [0, d), then host blocks for [d, n).
        self.tables: dict[str, list[KVBlock]] = {}
        self.host_tables: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are already published in the prefix cache.
        self._num_registered: dict[str, int] = {}
        # Contexts held for a finished request's expected continuation (retain()).
        self._retained: dict[int, RetainedContext] = {}
        # Device blocks being copied out during the current step: the copy overlaps the forward
        # pass, so they return to the pool only at the next step (release_swapped_out()).
        self._swapping_out: list[KVBlock] = []
        # Host blocks being written this step: published in the host tier only once the copy is done.
        self._host_pending: list[tuple[KVBlock, int, tuple[int, ...]]] = []
        # Host blocks that this step's copies read (swap-ins) or write (swap-outs) and that their
        # owner let go of: free only from the next step, so that no other copy of this step
        # (write-backs run first, swap-outs last) lands on one out of order.
        self._host_deferred: list[KVBlock] = []
        self._host_writing: set[int] = set()
        # The host link's budget for this step, in blocks: swap-ins, swap-outs and write-backs all
        # draw from it, so together they copy no more than hides behind the step's compute. The
        # scheduler opens it each step (open_link) and take_back_ups() closes it.
        self.link_budget = 0
        # Write-back (SGLang's write_back policy): a cached device block evicted while the link
        # budget has room is copied to the host tier instead of lost; only once the scheduler has
        # planned the swaps that come first (open_write_backs()).
        self._write_backs_open = False
        self._back_ups: list[tuple[int, int]] = []
        self._backed_up: list[KVBlock] = []
        # The device eviction key of each written-back block (None: plain LRU), kept in the host tier.
        self._backed_up_keys: list[float | None] = []
        # Set when finished requests' blocks are freed with eviction keys (prefix_eviction="reuse"):
        # host blocks read back are then keyed too, so that one order covers the whole tier.
        self.keyed_reloads = False
        if self.host is not None and enable_prefix_caching:
            self.device.on_evict = self._back_up

    def set_clock(self, now: float) -> None:
        """The scheduler's time, for the eviction order of blocks kept for an expected resume."""
        self.device.now = now
        if self.host is not None:
            self.host.now = now

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.device.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(self.tables.get(request.request_id, ())))

    def num_private_blocks_of(self, request_id: str) -> int:
        """The tail of a request's device table that no other table shares: what swapping or
        dropping it would free. References only grow toward the head (a prefix hit takes all
        blocks before the one it shares), so the private blocks are a suffix."""
        table = self.tables.get(request_id, ())
        n = 0
        while n < len(table) and table[len(table) - 1 - n].ref_cnt == 1:
            n += 1
        return n

    def private_device_tokens(self, request: Request) -> int:
        """Computed tokens held in the request's private device blocks."""
        rid = request.request_id
        d = self.num_device_blocks_of(rid)
        on_device = max(0, min(d * self.block_size, request.num_computed_tokens))
        return max(0, on_device - (d - self.num_private_blocks_of(rid)) * self.block_size)

    def _update_block_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else hash((self.hash_salt, request.cache_salt))
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hash((parent, tuple(request.tokens_slice(i * bs, (i + 1) * bs))))
            hashes.append(parent)

    def full_block_hashes(self, request: Request) -> list[int]:
        """The prefix-cache hashes of the request's full blocks (its token chain), head first."""
        self._update_block_hashes(request)
        return request.block_hashes

    def _block_key(self, request: Request, i: int) -> tuple[int, tuple[int, ...]]:
        bs = self.block_size
        return request.block_hashes[i], tuple(request.tokens_slice(i * bs, (i + 1) * bs))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest device-cached prefix of a request that holds no blocks yet, in whole blocks."""
        rid = request.request_id
        if not self.enable_prefix_caching or rid in self.tables or rid in self.host_tables:
            return [], 0
        self._update_block_hashes(request)
        hits: list[KVBlock] = []
        for i in range(len(request.block_hashes)):
            block = self.device.lookup(*self._block_key(request, i))
            if block is None:
                break
            hits.append(block)
        # The last token must be computed to produce logits, so a full hit backs off one block.
        if hits and len(hits) * self.block_size >= request.num_tokens:
            hits.pop()
        return hits, len(hits) * self.block_size

    def get_host_hits(self, request: Request, num_device_hits: int) -> list[KVBlock]:
        """Host-tier blocks that continue a request's device hits (call after get_computed_blocks)."""
        if self.host is None or not self.enable_prefix_caching:
            return []
        hits: list[KVBlock] = []
        for i in range(num_device_hits, len(request.block_hashes)):
            if (i + 1) * self.block_size >= request.num_tokens:
                break  # the last token is always computed
            block = self.host.lookup(*self._block_key(request, i))
            if block is None:
                break
            hits.append(block)
        return hits

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

    def attach_host_hits(self, request: Request, device_hits: list[KVBlock], host_hits: list[KVBlock]) -> None:
        """Take a request's device and host-tier hits as its context (device part first, host part
        after it), to be swapped in like a resumed swapped-out request before it runs."""
        assert host_hits and request.num_computed_tokens == 0
        rid = request.request_id
        self.device.touch(device_hits)
        if device_hits:
            self.tables[rid] = list(device_hits)
        self.host.touch(host_hits)
        self.host_tables[rid] = list(host_hits)
        self._num_registered[rid] = len(device_hits)
        request.num_computed_tokens = (len(device_hits) + len(host_hits)) * self.block_size

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
        for i in range(start, n_full):
            self.device.register(table[i], *self._block_key(request, i))
        self._num_registered[request.request_id] = n_full

    def free(self, request: Request, reuse_at: list[float] | None = None) -> None:
        """Drop a request's blocks; the cached ones stay findable until evicted. `reuse_at`: one
        eviction key per device block, head first (ReuseTracker.finish); without it the device
        blocks are evicted least recently freed first."""
        rid = request.request_id
        table = self.tables.pop(rid, None)
        if table:
            if reuse_at is not None and len(reuse_at) != len(table):
                raise ValueError(f"request {rid}: {len(reuse_at)} eviction keys for {len(table)} blocks")
            self.device.free(list(reversed(table)), list(reversed(reuse_at)) if reuse_at is not None else None)
        host_table = self.host_tables.pop(rid, None)
        if host_table:
            self._free_host(list(reversed(host_table)))
        self._num_registered.pop(rid, None)

    def release(self, request: Request, reuse_at: float | None = None, block_recompute_s: float = 0.0) -> None:
        """Give up a paused request's context without destroying it: its published blocks stay in
        the device and host caches, evictable, and a prefix hit on resume revives what is still
        there. The request restarts from token 0. Eviction key of block i of n: `reuse_at` (its
        expected resume; None: plain LRU) lowered by (n - i) * `block_recompute_s`, the recompute
        that losing it costs (it and everything after it), so a context's head outlives its tail."""
        rid = request.request_id
        for free, table in ((self.device.free, self.tables.pop(rid, None)),
                            (self._free_host, self.host_tables.pop(rid, None))):
            if not table:
                continue
            keys = None
            if reuse_at is not None:
                n = len(table)
                keys = [reuse_at - (n - i) * block_recompute_s for i in range(n)]
                keys.reverse()
            free(list(reversed(table)), keys)
        self._num_registered.pop(rid, None)
        request.num_computed_tokens = 0

    # ---- retained contexts ---------------------------------------------------------------
    def retain(self, request: Request) -> RetainedContext | None:
        """Free a finished request's KV but keep its cached blocks held by a handle: the context
        stays on the device (not evictable) until release_retained(). The uncached tail (a partial
        last block) is freed. None, with everything freed as by free(), when nothing is cached or
        part of the context is on the host."""
        rid = request.request_id
        n = self._num_registered.get(rid, 0)
        if n == 0 or rid in self.host_tables or rid not in self.tables:
            self.free(request)
            return None
        table = self.tables.pop(rid)
        self._num_registered.pop(rid, None)
        self.device.free(list(reversed(table[n:])))
        handle = RetainedContext(table[:n])
        self._retained[id(handle)] = handle
        return handle

    def release_retained(self, handle: RetainedContext) -> int:
        """Let a retained context go into the prefix cache (evictable, still findable: a late
        continuation recomputes only what was evicted since). Returns the device blocks freed."""
        if self._retained.pop(id(handle), None) is None:
            return 0
        before = self.device.num_free_blocks
        self.device.free(list(reversed(handle.blocks)))
        handle.blocks = []
        return self.device.num_free_blocks - before

    @property
    def num_retained_blocks(self) -> int:
        """Device blocks that only retained contexts hold: what releasing every one would free (a
        system prompt two histories share counts once; one a running request shares, not at all)."""
        refs = Counter(b.block_id for h in self._retained.values() for b in h.blocks)
        return sum(1 for bid, n in refs.items() if self.device.blocks[bid].ref_cnt == n)

    # ---- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        refs = Counter(b.block_id for table in self.tables.values() for b in table)
        refs.update(b.block_id for b in self._swapping_out)
        refs.update(b.block_id for h in self._retained.values() for b in h.blocks)
        for rid, table in self.host_tables.items():
            assert table, f"request {rid} has an empty host table"
            assert len({b.block_id for b in table}) == len(table), f"request {rid} holds a host block twice"
        for rid, table in self.tables.items():
            assert table, f"request {rid} has an empty device table"
            assert len({b.block_id for b in table}) == len(table), f"request {rid} holds a block twice"
        self.device.check_invariants(refs)
        if self.host is not None:
            host_refs = Counter(b.block_id for t in self.host_tables.values() for b in t)
            host_refs.update(b.block_id for b in self._host_deferred + self._backed_up)
            self.host.check_invariants(host_refs)
            pending = [b.block_id for b, _, _ in self._host_pending]
            assert len(set(pending)) == len(pending), "a host block is written twice in one step"
        else:
            assert not self.host_tables and not self._host_pending and not self._back_ups

    def num_held_blocks(self) -> int:
        return sum(len(t) for t in self.tables.values())
