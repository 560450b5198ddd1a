"""The host tier: a second block pool that holds swapped-out contexts and, through the prefix
cache, blocks evicted from the device (SGLang's HiCache write-back, ANCHORS.md §1).

Its state is its own: the host pool, each request's host part, and the copies in flight this
step. The device side (the device pool and block tables, the host link's budget) is the
manager's and the host side's (segue/kv/host_side.py): they hand the tier the device blocks
that move and apply what it returns. A manager without host memory has no HostTier at all.
"""
from __future__ import annotations

from collections import Counter

from segue.kv.block_pool import BlockPool, KVBlock
from segue.kv.hashing import BlockHasher
from segue.kv.host_link import WriteBackOutcomes
from segue.kv.interface import Copies
from segue.request import Request


class HostTier:
    def __init__(self, pool: BlockPool, hasher: BlockHasher, enable_prefix_caching: bool) -> None:
        self.pool = pool
        self.hasher = hasher
        self.enable_prefix_caching = enable_prefix_caching
        # A request's context: device blocks for block indices [0, d), then these for [d, n).
        self._tables: dict[str, list[KVBlock]] = {}
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
            pool.on_evict = self.write_backs.on_evict

    # ---- each request's host part --------------------------------------------------------
    @property
    def tables(self) -> dict[str, list[KVBlock]]:
        """Each request's host blocks, for reading (the tier's verbs change them)."""
        return self._tables

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def pop_table(self, request_id: str) -> list[KVBlock] | None:
        """Take a request's host part away (the caller frees it)."""
        return self._tables.pop(request_id, None)

    def truncate(self, request_id: str, keep: int) -> None:
        """Free a request's host blocks after its first `keep` ones."""
        host = self._tables.get(request_id, [])
        if not host[keep:]:
            return
        self.free(list(reversed(host[keep:])))
        if keep:
            self._tables[request_id] = host[:keep]
        else:
            del self._tables[request_id]

    def attach(self, request_id: str, hits: list[KVBlock]) -> None:
        """Take host-tier prefix hits as a request's host part."""
        self.pool.touch(hits)
        self.write_backs.on_read(hits)
        self._tables[request_id] = list(hits)

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

    # ---- swapping: the host half ---------------------------------------------------------
    def store(self, request: Request, moving: list[KVBlock], start: int) -> Copies:
        """Swap-out: the device blocks `moving` (block indices from `start`, the private tail of
        the request's device part) go to the front of its host part; returns the (device, host)
        copies. A block whose content the host tier already holds is not copied."""
        rid = request.request_id
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
        self._tables[rid] = host_blocks + self._tables.get(rid, [])
        return copies

    def drop_front(self, request_id: str, n: int) -> None:
        """Swap-in: the first `n` host blocks of the request are on the device now; they stay
        held until this step's copies are done (release_step)."""
        host_table = self._tables[request_id]
        moving = host_table[:n]
        del host_table[:n]
        if not host_table:
            del self._tables[request_id]
        self._deferred.extend(reversed(moving))

    # ---- write-back ----------------------------------------------------------------------
    def write_back(self, block: KVBlock, stalled: bool) -> bool:
        """Copy a cached device block about to be reused into the tier, unless it already holds
        its content or is full; `stalled`: the copy is past the link's budget. True if copied."""
        # Only cached blocks are evicted through the device pool's hook: they carry their key.
        assert block.block_hash is not None and block.token_ids is not None
        copy = self.pool.lookup(block.block_hash, block.token_ids)
        if copy is not None:
            if self.keyed_reloads and block.reuse_at is not None:
                self.pool.rekey(copy, block.reuse_at)  # the host copy now stands for the block
            return False
        if not self.pool.num_free_blocks:
            return False
        hb = self.pool.allocate(1)[0]
        if stalled:
            self.num_stalled_write_backs += 1
        self._back_ups.append((block.block_id, hb.block_id))
        self._pending.append((hb, block.block_hash, block.token_ids))
        self._backed_up.append(hb)
        self._backed_up_keys.append(block.reuse_at)
        return True

    def take_back_ups(self) -> Copies:
        out, self._back_ups = self._back_ups, []
        return out

    # ---- the step's copies are done ------------------------------------------------------
    def release_step(self) -> None:
        """The previous step's copies are done: the host copies become findable (a block freed
        since then is left out: its slot may be reused) and the blocks they read are let go."""
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

    def lose_step(self) -> set[int]:
        """The step's copies failed (its executor raised): nothing they wrote holds data. Its
        write-backs are dropped unpublished (freed from the next step, as blocks this step let go
        of are); returns the host blocks its swap-outs wrote, whose owners' contexts the caller
        cuts back before them (their free() then unpublishes them too)."""
        if self._backed_up:
            lost = {b.block_id for b in self._backed_up}
            self._pending = [p for p in self._pending if p[0].block_id not in lost]
            self._deferred.extend(self._backed_up)
            self._backed_up, self._backed_up_keys = [], []
        return set(self._writing)

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
        for rid, table in self._tables.items():
            assert table, f"request {rid} has an empty host table"
            assert len({b.block_id for b in table}) == len(table), f"request {rid} holds a host block twice"
        refs = Counter(b.block_id for t in self._tables.values() for b in t)
        refs.update(b.block_id for b in self._deferred + self._backed_up)
        self.pool.check_invariants(refs)
        pending = [b.block_id for b, _, _ in self._pending]
        assert len(set(pending)) == len(pending), "a host block is written twice in one step"
