"""Per-request block tables over a device pool and a host pool, both indexed by the prefix cache.

The host pool is a second tier of the prefix cache (SGLang's HiCache, ANCHORS.md §1): a block
copied out keeps its hash there, so any request whose prefix continues past its device hits into
host-resident blocks loads them instead of recomputing them. The manager composes two parts and
moves blocks between them: the device side (segue/kv/device_tables.py: the device pool and the
block tables) and the host side (segue/kv/host_side.py: the host link, the copies in flight and
the host tier); neither holds the other's state.
The scheduler sees the verbs of segue/kv/interface.py's KVCache, which this class implements.
"""
from __future__ import annotations

from collections import Counter

from segue.kv.block_pool import BlockPool, KVBlock
from segue.kv.device_tables import DeviceTables
from segue.kv.hashing import BlockHasher
from segue.kv.host_side import HostSide
from segue.kv.interface import NO_HIT, Copies, Held, KVCounters, Moved, PrefixHit, RetainedContext
from segue.kv.retained import RetainedContexts
from segue.kv.reuse import ReuseTracker
from segue.request import Request


class KVCacheManager:
    def __init__(self, block_size: int, num_device_blocks: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, hash_salt: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_salt = hash_salt
        self._hasher = BlockHasher(block_size, hash_salt)
        # The pools and tables are segue/kv's own: other modules use the verbs below
        # (tests/test_architecture.py fails otherwise), so the layout can change behind them.
        self.device = BlockPool(num_device_blocks, enable_prefix_caching, "device")
        self._dev = DeviceTables(self.device, self._hasher, enable_prefix_caching)
        # Contexts held for a finished request's expected continuation (retain()).
        self._retained = RetainedContexts(self.device)
        self._host = HostSide(self.device, num_host_blocks, self._hasher, enable_prefix_caching)
        self.host = self._host.pool
        # Expected reuse of finished requests' blocks (use_reuse_eviction); None: plain LRU.
        self._reuse: ReuseTracker | None = None

    def use_reuse_eviction(self, on: bool) -> None:
        """Key finished requests' cached blocks by their expected reuse (finish(); ReuseTracker),
        and host blocks read back with them (HostTier.keyed_reloads), or plain LRU."""
        self._reuse = ReuseTracker() if on else None
        self.keyed_reloads = on

    @property
    def keyed_reloads(self) -> bool:
        """Whether host blocks read back are keyed for eviction (HostTier.keyed_reloads)."""
        return self._host.tier is not None and self._host.tier.keyed_reloads

    @keyed_reloads.setter
    def keyed_reloads(self, on: bool) -> None:
        if self._host.tier is not None:
            self._host.tier.keyed_reloads = on

    def begin_step(self, now: float) -> None:
        """The scheduler's clock moves on (set_clock) and the previous step's copies are done."""
        self.set_clock(now)
        self.release_swapped_out()

    def set_clock(self, now: float) -> None:
        """The scheduler's time, for the eviction order of blocks kept for an expected resume."""
        self.device.now = now
        if self.host is not None:
            self.host.now = now

    # ---- queries -------------------------------------------------------------------------
    # What the scheduler, the engine and the metrics read; they never see the pools or tables.
    def counters(self) -> KVCounters:
        """The pools and the host link now (a snapshot: read it again after a verb)."""
        host = self.host
        return KVCounters(self.device.num_blocks, self.device.num_free_blocks,
                          host.num_blocks if host is not None else 0, host.num_free_blocks if host is not None else 0,
                          len(self._host.swapping_out), self._host.link.budget, self._host.write_back_reuse_rate())

    def held(self, request_id: str) -> Held:
        return Held(self._dev.num_blocks_of(request_id), self._host.num_blocks_of(request_id))

    def holders(self, on_host: bool = False) -> list[str]:
        """The requests that hold device blocks, or with `on_host` host blocks (bounded by the
        pools, unlike the queues)."""
        return list(self._host.tables) if on_host else self._dev.holders()

    def num_held_blocks(self) -> int:
        """Device blocks in requests' tables (counted once per table that holds them)."""
        return self._dev.num_held_blocks()

    def block_ids(self, request_id: str) -> list[int]:
        return self._dev.block_ids(request_id)

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        return self._dev.num_blocks_needed(request, num_new_tokens)

    def num_private_blocks_of(self, request_id: str) -> int:
        """The tail of a request's device table that no other table shares: what swapping or
        dropping it would free."""
        return self._dev.num_private_blocks_of(request_id)

    def private_device_tokens(self, request: Request) -> int:
        """Computed tokens held in the request's private device blocks."""
        rid = request.request_id
        d = self._dev.num_blocks_of(rid)
        on_device = max(0, min(d * self.block_size, request.num_computed_tokens))
        return max(0, on_device - (d - self.num_private_blocks_of(rid)) * self.block_size)

    def num_freed_by_release(self, request_ids: list[str], handles: list[RetainedContext],
                             hit: PrefixHit) -> int:
        """Device blocks that releasing these requests' device tables and these retained handles,
        all of them, would free, `hit`'s not counted: a freed block that a request is about to
        take as a cached hit gives it no room. A block shared with a holder outside the set stays."""
        return self._dev.num_freed_by_release(request_ids, handles, hit)

    # Shorthands for tests and the simulator (the scheduler reads counters() and held()).
    @property
    def tables(self) -> dict[str, list[KVBlock]]: return self._dev.tables
    @property
    def host_tables(self) -> dict[str, list[KVBlock]]: return self._host.tables
    @property
    def num_blocks(self) -> int: return self.device.num_blocks
    @property
    def num_free_blocks(self) -> int: return self.device.num_free_blocks
    @property
    def num_swapping_out_blocks(self) -> int: return len(self._host.swapping_out)
    @property
    def num_stalled_write_backs(self) -> int: return self._host.num_stalled_write_backs
    def num_device_blocks_of(self, request_id: str) -> int: return self._dev.num_blocks_of(request_id)
    def num_host_blocks_of(self, request_id: str) -> int: return self._host.num_blocks_of(request_id)
    def write_back_reuse_rate(self) -> float: return self._host.write_back_reuse_rate()

    # ---- prefix cache and allocation -----------------------------------------------------
    def full_block_hashes(self, request: Request) -> list[int]:
        """The prefix-cache hashes of the request's full blocks (its token chain), head first."""
        return self._hasher.update(request)

    def match(self, request: Request) -> PrefixHit:
        """Longest device-cached prefix of a request that holds no blocks yet, in whole blocks."""
        rid = request.request_id
        if not self.enable_prefix_caching or rid in self._dev.tables or self._host.num_blocks_of(rid):
            return NO_HIT
        return self._dev.match(request)

    def match_host(self, request: Request, hit: PrefixHit) -> PrefixHit:
        """`hit` (from match) with the host-tier blocks that continue it."""
        if not self.enable_prefix_caching:
            return hit
        return PrefixHit(hit._device, tuple(self._host.lookup_hits(request, hit.num_blocks)), hit.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Grow the request's table to hold its computed tokens plus `num_new_tokens` more. The
        device blocks of `hit` (from match) are attached first. False if it doesn't fit; nothing
        changes in that case."""
        return self._dev.allocate(request, num_new_tokens, list(hit._device), hit.num_free())

    def attach_host_hit(self, request: Request, hit: PrefixHit) -> None:
        """Take a request's device and host-tier hits (match_host) as its context (device part
        first, host part after it), to be swapped in like a resumed swapped-out request before
        it runs."""
        device_hits, host_hits = list(hit._device), list(hit._host)
        assert host_hits and request.num_computed_tokens == 0
        self._dev.attach(request.request_id, device_hits)
        self._host.attach(request.request_id, host_hits)
        request.num_computed_tokens = (len(device_hits) + len(host_hits)) * self.block_size

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the blocks whose every token is now computed (call after num_computed advances)."""
        if self.enable_prefix_caching and not self._host.num_blocks_of(request.request_id):
            self._dev.publish(request)

    # ---- giving memory back --------------------------------------------------------------
    def free(self, request: Request, reuse_at: list[float] | None = None) -> None:
        """Drop a request's blocks; the cached ones stay findable until evicted. `reuse_at`: one
        eviction key per device block, head first (ReuseTracker.finish); without it the device
        blocks are evicted least recently freed first."""
        rid = request.request_id
        self._dev.free(rid, reuse_at)
        self._host.free(rid)
        self._dev.forget(rid)

    def finish(self, request: Request, now: float, block_recompute_s: float) -> None:
        """Free a finished request's KV; with reuse eviction on, its cached blocks are keyed by
        their expected reuse (the chain it continued, shared blocks' own history; ReuseTracker),
        each lowered by the recompute that losing it costs."""
        rid = request.request_id
        n = self._dev.num_blocks_of(rid)
        if self._reuse is None or n == 0 or self._host.num_blocks_of(rid):
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
        self._dev.release(rid, reuse_at, block_recompute_s)
        self._host.free(rid, reuse_at, block_recompute_s)
        self._dev.forget(rid)
        request.num_computed_tokens = 0

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep only a paused request's first `num_tokens` tokens of context, in whole blocks
        (the caller cuts its tokens). The blocks after them, on the device or the host, are freed
        (published ones stay findable); a partly kept block is dropped too, since a published
        block must not be rewritten, so up to block_size - 1 kept tokens are computed again."""
        keep = num_tokens // self.block_size
        rid = request.request_id
        self._host.truncate(rid, max(0, keep - self._dev.num_blocks_of(rid)))
        self._dev.truncate(rid, keep)
        request.num_computed_tokens = min(request.num_computed_tokens, keep * self.block_size)
        del request.block_hashes[keep:]

    # ---- retained contexts ---------------------------------------------------------------
    def retain(self, request: Request) -> RetainedContext | None:
        """Free a finished request's KV but keep its cached blocks held by a handle: the context
        stays on the device (not evictable) until release_retained(). The uncached tail (a partial
        last block) is freed. None, with everything freed as by free(), when nothing is cached or
        part of the context is on the host."""
        rid = request.request_id
        if self._dev.num_registered(rid) == 0 or self._host.num_blocks_of(rid) or rid not in self._dev.tables:
            self.free(request)
            return None
        return self._retained.hold(self._dev.detach_published(rid))

    def release_retained(self, handle: RetainedContext) -> int:
        """Let a retained context go into the prefix cache (evictable, still findable: a late
        continuation recomputes only what was evicted since). Returns the device blocks freed."""
        return self._retained.release(handle)

    @property
    def num_retained_blocks(self) -> int:
        """Device blocks that only retained contexts hold: what releasing every one would free."""
        return self._retained.num_private_blocks()

    # ---- the host tier: swaps and the link -----------------------------------------------
    def swap_out(self, request: Request, max_blocks: int) -> Moved:
        """Move up to max_blocks of the request's private device tail to the host; the copies
        are (device, host) pairs (HostSide.swap_out)."""
        rid = request.request_id
        copies, n = self._host.swap_out(request, self._dev.tables.get(rid, []), max_blocks)
        self._dev.cut_tail(rid, n)
        return Moved(copies, n, self._host.num_blocks_of(rid))

    def swap_in(self, request: Request, max_blocks: int) -> Moved:
        """Bring host blocks back to the device, up to max_blocks copies; the copies are (host,
        device) pairs (HostSide.swap_in)."""
        rid = request.request_id
        copies, new_blocks = self._host.swap_in(request, max_blocks)
        self._dev.extend(rid, new_blocks)
        return Moved(copies, len(new_blocks), self._host.num_blocks_of(rid))

    def release_swapped_out(self) -> None:
        """The previous step's copies are done (HostSide.release_swapped_out)."""
        self._host.release_swapped_out()

    def open_link(self, blocks: int) -> None:
        """A step begins: its copies may move `blocks` blocks in all. Write-backs wait for
        open_write_backs(), so that the swaps planned first take their share before them."""
        self._host.link.open(blocks)

    def open_write_backs(self, past_budget: bool = False) -> None:
        """Cached device blocks evicted from now on are written back within what is left, or
        also past it (stalling the step for the copy) with `past_budget`."""
        self._host.link.write_backs_open = True
        self._host.link.write_backs_past_budget = past_budget

    def take_back_ups(self) -> Copies:
        """This step's write-back copies (device, host); the link budget ends with the step."""
        return self._host.take_back_ups()

    def lose_step_copies(self, swap_in: Copies) -> dict[str, int]:
        """The step's copies never landed (its executor failed): its write-backs are dropped, and
        each request whose context they carried (host blocks its swap-outs wrote, device blocks
        its swap-ins wrote, `swap_in`) maps to how many of its device blocks, from the head, still
        hold good data. The caller cuts each one there (truncate); its tokens after are computed
        again rather than read from blocks that hold whatever was there before."""
        tier = self._host.tier
        written = tier.lose_step() if tier is not None else set()
        landed = {d for _, d in swap_in}
        cut: dict[str, int] = {}
        if written:
            for rid, table in self._host.tables.items():
                if any(b.block_id in written for b in table):
                    cut[rid] = self._dev.num_blocks_of(rid)
        if landed:
            for rid, table in self._dev.tables.items():
                first = next((i for i, b in enumerate(table) if b.block_id in landed), None)
                if first is not None:
                    cut[rid] = min(first, cut.get(rid, first))
        return cut

    def check_invariants(self) -> None:
        refs = Counter(b.block_id for b in self._host.swapping_out)
        refs.update(b.block_id for b in self._retained.blocks())
        self._dev.check_invariants(refs)
        self._host.check_invariants()
