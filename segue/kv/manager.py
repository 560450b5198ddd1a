"""Per-request block tables over a device pool and a host pool, both indexed by the prefix cache.

The host pool is a second tier of the prefix cache (SGLang's HiCache, ANCHORS.md §1): a block
copied out keeps its hash there, so any request whose prefix continues past its device hits into
host-resident blocks loads them instead of recomputing them. The host-tier side of the manager
(host queries, host hits, swaps, write-backs and the link budget) is in manager_host.py.
"""
from __future__ import annotations

from collections import Counter

from segue.kv.block_pool import BlockPool, KVBlock, num_private_tail
from segue.kv.hashing import BlockHasher
from segue.kv.host_tier import HostLink, HostTier
from segue.kv.interface import NO_HIT, Held, KVCounters, PrefixHit, RetainedContext, cdiv
from segue.kv.manager_host import HostTierSide
from segue.kv.retained import RetainedContexts
from segue.kv.reuse import ReuseTracker
from segue.request import Request


class KVCacheManager(HostTierSide):
    def __init__(self, block_size: int, num_device_blocks: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, hash_salt: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_salt = hash_salt
        self._hasher = BlockHasher(block_size, hash_salt)
        # The pools and tables below are segue/kv's own: other modules use the queries further
        # down (tests/test_architecture.py fails otherwise), so the layout can change behind them.
        self.device = BlockPool(num_device_blocks, enable_prefix_caching, "device")
        # A request's device blocks, head first; the host tier holds the rest of its context.
        self.tables: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are already published in the prefix cache.
        self._num_registered: dict[str, int] = {}
        # Contexts held for a finished request's expected continuation (retain()).
        self._retained = RetainedContexts(self.device)
        # The scheduler opens the link each step (open_link) and take_back_ups() closes it.
        self._link = HostLink()
        self._tier: HostTier | None = None
        if num_host_blocks > 0:
            self._tier = HostTier(BlockPool(num_host_blocks, enable_prefix_caching, "host"), self.device,
                                  self.tables, self._num_registered, self._hasher, self._link,
                                  enable_prefix_caching)
        self.host = self._tier.pool if self._tier is not None else None
        # Expected reuse of finished requests' blocks (use_reuse_eviction); None: plain LRU.
        self._reuse: ReuseTracker | None = None

    def use_reuse_eviction(self, on: bool) -> None:
        """Key finished requests' cached blocks by their expected reuse (finish(); ReuseTracker),
        and host blocks read back with them (HostTier.keyed_reloads), or plain LRU."""
        self._reuse = ReuseTracker() if on else None
        self.keyed_reloads = on

    def begin_step(self, now: float) -> None:
        """The scheduler's clock moves on (set_clock) and the previous step's copies are done."""
        self.set_clock(now)
        self.release_swapped_out()

    def set_clock(self, now: float) -> None:
        """The scheduler's time, for the eviction order of blocks kept for an expected resume."""
        self.device.now = now
        if self.host is not None:
            self.host.now = now

    # ---- queries: the pools --------------------------------------------------------------
    # What the scheduler, the engine and the metrics read; they never see the pools or tables.
    # Device pool: its size, free and used blocks, and the used fraction.
    @property
    def num_blocks(self) -> int: return self.device.num_blocks
    @property
    def num_free_blocks(self) -> int: return self.device.num_free_blocks
    @property
    def num_used_blocks(self) -> int: return self.device.num_used_blocks
    def usage(self) -> float: return self.device.usage()

    def counters(self) -> KVCounters:
        """The pools and the host link now (a snapshot: read it again after a verb)."""
        host = self.host
        return KVCounters(self.device.num_blocks, self.device.num_free_blocks,
                          host.num_blocks if host is not None else 0, host.num_free_blocks if host is not None else 0,
                          self.num_swapping_out_blocks, self._link.budget, self.write_back_reuse_rate())

    def num_held_blocks(self) -> int:
        """Device blocks in requests' tables (counted once per table that holds them)."""
        return sum(len(t) for t in self.tables.values())

    # ---- queries: one request ------------------------------------------------------------
    def held(self, request_id: str) -> Held:
        return Held(len(self.tables.get(request_id, ())), len(self.host_tables.get(request_id, ())))

    def holders(self, on_host: bool = False) -> list[str]:
        """The requests that hold device blocks, or with `on_host` host blocks (bounded by the
        pools, unlike the queues)."""
        if on_host:
            return list(self.host_tables)
        return [rid for rid, table in self.tables.items() if table]

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def num_device_blocks_of(self, request_id: str) -> int:
        return len(self.tables.get(request_id, ()))

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(self.tables.get(request.request_id, ())))

    def num_private_blocks_of(self, request_id: str) -> int:
        """The tail of a request's device table that no other table shares: what swapping or
        dropping it would free."""
        return num_private_tail(self.tables.get(request_id, []))

    def private_device_tokens(self, request: Request) -> int:
        """Computed tokens held in the request's private device blocks."""
        rid = request.request_id
        d = self.num_device_blocks_of(rid)
        on_device = max(0, min(d * self.block_size, request.num_computed_tokens))
        return max(0, on_device - (d - self.num_private_blocks_of(rid)) * self.block_size)

    def num_freed_by_release(self, request_ids: list[str], handles: list[RetainedContext],
                             hit: PrefixHit) -> int:
        """Device blocks that releasing these requests' device tables and these retained handles,
        all of them, would free, `hits` not counted: a freed block that a request is about to take
        as a cached hit gives it no room. A block shared with a holder outside the set stays."""
        refs = Counter(b.block_id for rid in request_ids for b in self.tables.get(rid, ()))
        refs.update(b.block_id for h in handles for b in h.blocks)
        taken = set(hit.block_ids)
        return sum(1 for bid, n in refs.items() if self.device.blocks[bid].ref_cnt == n and bid not in taken)

    # ---- prefix cache --------------------------------------------------------------------
    def full_block_hashes(self, request: Request) -> list[int]:
        """The prefix-cache hashes of the request's full blocks (its token chain), head first."""
        return self._hasher.update(request)

    def _block_key(self, request: Request, i: int) -> tuple[int, tuple[int, ...]]:
        return self._hasher.key(request, i)

    def match(self, request: Request) -> PrefixHit:
        """Longest device-cached prefix of a request that holds no blocks yet, in whole blocks."""
        rid = request.request_id
        if not self.enable_prefix_caching or rid in self.tables or rid in self.host_tables:
            return NO_HIT
        self._hasher.update(request)
        hits: list[KVBlock] = []
        for i in range(len(request.block_hashes)):
            block = self.device.lookup(*self._block_key(request, i))
            if block is None:
                break
            hits.append(block)
        # The last token must be computed to produce logits, so a full hit backs off one block.
        if hits and len(hits) * self.block_size >= request.num_tokens:
            hits.pop()
        return PrefixHit(tuple(hits), (), self.block_size)

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Grow the request's table to hold its computed tokens plus `num_new_tokens` more. The
        device blocks of `hit` (from match) are attached first. False if it doesn't fit; nothing
        changes in that case."""
        computed_blocks = list(hit._device)
        table = self.tables.get(request.request_id, [])
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = cdiv(total, self.block_size) - len(table) - len(computed_blocks)
        # Cached hits sitting in the free list stop being free once we take them.
        if need > self.device.num_free_blocks - hit.num_free():
            return False
        self.device.touch(computed_blocks)
        table = table + computed_blocks + (self.device.allocate(need) if need > 0 else [])
        self.tables[request.request_id] = table
        return True

    def attach_host_hit(self, request: Request, hit: PrefixHit) -> None:
        """Take a request's device and host-tier hits (match_host) as its context (device part
        first, host part after it), to be swapped in like a resumed swapped-out request before
        it runs."""
        device_hits, host_hits = list(hit._device), list(hit._host)
        assert host_hits and request.num_computed_tokens == 0
        assert self._tier is not None, "host hits without a host tier"
        rid = request.request_id
        self.device.touch(device_hits)
        if device_hits:
            self.tables[rid] = list(device_hits)
        self._tier.attach(rid, host_hits)
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
        self._hasher.update(request)
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
        if host_table and self._tier is not None:
            self._tier.free(list(reversed(host_table)))
        self._num_registered.pop(rid, None)

    def finish(self, request: Request, now: float, block_recompute_s: float) -> None:
        """Free a finished request's KV; with reuse eviction on, its cached blocks are keyed by
        their expected reuse (the chain it continued, shared blocks' own history; ReuseTracker),
        each lowered by the recompute that losing it costs."""
        rid = request.request_id
        n = self.num_device_blocks_of(rid)
        if self._reuse is None or n == 0 or rid in self.host_tables:
            self.free(request)
            return
        full = request.block_hashes[:min(n, request.num_computed_tokens // self.block_size)]
        cls = self._reuse.admit(full, now)
        self.free(request, self._reuse.finish(full, n, cls, now, block_recompute_s))

    def release(self, request: Request, reuse_at: float | None = None, block_recompute_s: float = 0.0) -> None:
        """Give up a paused request's context without destroying it: its published blocks stay in
        the device and host caches, evictable, and a prefix hit on resume revives what is still
        there. The request restarts from token 0. Eviction key of block i of n: `reuse_at` (its
        expected resume; None: plain LRU) lowered by (n - i) * `block_recompute_s`, the recompute
        that losing it costs (it and everything after it), so a context's head outlives its tail."""
        rid = request.request_id
        tiers = [(self.device.free, self.tables.pop(rid, None))]
        if self._tier is not None:
            tiers.append((self._tier.free, self._tier.tables.pop(rid, None)))
        for free, table in tiers:
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

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep only a paused request's first `num_tokens` tokens of context, in whole blocks
        (the caller cuts its tokens). The blocks after them, on the device or the host, are freed
        (published ones stay findable); a partly kept block is dropped too, since a published
        block must not be rewritten, so up to block_size - 1 kept tokens are computed again."""
        keep = num_tokens // self.block_size
        rid = request.request_id
        device, host = self.tables.get(rid, []), self.host_tables.get(rid, [])
        host_keep = max(0, keep - len(device))
        if host[host_keep:] and self._tier is not None:
            self._tier.free(list(reversed(host[host_keep:])))
            if host_keep:
                self._tier.tables[rid] = host[:host_keep]
            else:
                del self._tier.tables[rid]
        if device[keep:]:
            self.device.free(list(reversed(device[keep:])))
            if keep:
                self.tables[rid] = device[:keep]
            else:
                del self.tables[rid]
        if rid in self._num_registered:
            self._num_registered[rid] = min(self._num_registered[rid], keep)
        request.num_computed_tokens = min(request.num_computed_tokens, keep * self.block_size)
        del request.block_hashes[keep:]

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
        return self._retained.hold(table[:n])

    def release_retained(self, handle: RetainedContext) -> int:
        """Let a retained context go into the prefix cache (evictable, still findable: a late
        continuation recomputes only what was evicted since). Returns the device blocks freed."""
        return self._retained.release(handle)

    @property
    def num_retained_blocks(self) -> int:
        """Device blocks that only retained contexts hold: what releasing every one would free."""
        return self._retained.num_private_blocks()

    # ---- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        refs = Counter(b.block_id for table in self.tables.values() for b in table)
        if self._tier is not None:
            refs.update(b.block_id for b in self._tier.swapping_out)
        refs.update(b.block_id for b in self._retained.blocks())
        for rid, table in self.tables.items():
            assert table, f"request {rid} has an empty device table"
            assert len({b.block_id for b in table}) == len(table), f"request {rid} holds a block twice"
        self.device.check_invariants(refs)
        if self._tier is not None:
            self._tier.check_invariants()
