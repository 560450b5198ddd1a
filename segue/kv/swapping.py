"""Moving KV between the device and host pools: budgeted, chunked swap-out of a request's private
tail and swap-in of its host part, and write-back of evicted prefix-cache blocks into the host
tier. A mixin of KVCacheManager (segue/kv/manager.py), which owns the state it uses."""
from __future__ import annotations

from typing import TYPE_CHECKING

from segue.kv.block_pool import KVBlock
from segue.request import Request

if TYPE_CHECKING:
    from segue.kv.block_pool import BlockPool


class SwapMixin:
    tables: dict[str, list[KVBlock]]
    host_tables: dict[str, list[KVBlock]]
    device: BlockPool
    host: BlockPool | None
    _backed_up: list[KVBlock]
    _backed_up_keys: list[float | None]
    keyed_reloads: bool

    # ---- swapping ------------------------------------------------------------------------
    # Swap-out moves the private tail of the device part to the front of the host part; swap-in
    # moves the front of the host part to the end of the device part. Either can stop after any
    # block, so a context moves in budgeted chunks across steps. Shared blocks never move: they
    # free nothing, and a later swap-in would duplicate what the device still holds.
    def open_link(self, blocks: int) -> None:
        """A step begins: its copies may move `blocks` blocks in all. Write-backs wait for
        open_write_backs(), so that the swaps planned first take their share before them."""
        self.link_budget = blocks
        self._write_backs_open = False

    def open_write_backs(self) -> None:
        """Cached device blocks evicted from now on are written back within what is left."""
        self._write_backs_open = True

    def num_device_blocks_of(self, request_id: str) -> int:
        return len(self.tables.get(request_id, ()))

    def num_host_blocks_of(self, request_id: str) -> int:
        return len(self.host_tables.get(request_id, ()))

    def swap_out_blocks(self, request: Request, max_blocks: int) -> list[tuple[int, int]]:
        """Move up to max_blocks of the request's private device tail to the host; returns the
        (device, host) copies. A block whose content the host tier already holds is not copied."""
        if self.host is None or max_blocks <= 0:
            return []
        rid = request.request_id
        table = self.tables.get(rid, [])
        n = min(max_blocks, self.num_private_blocks_of(rid), self.host.num_free_blocks)
        if n <= 0:
            return []
        start = len(table) - n
        moving = table[start:]
        full = request.num_computed_tokens // self.block_size
        if self.enable_prefix_caching:
            self._update_block_hashes(request)
        copies, host_blocks = [], []
        for i, dev in enumerate(moving, start):
            key = self._block_key(request, i) if self.enable_prefix_caching and i < full else None
            hb = self.host.lookup(*key) if key is not None else None
            if hb is not None:
                self.host.touch([hb])
            else:
                hb = self.host.allocate(1)[0]
                copies.append((dev.block_id, hb.block_id))
                self._host_writing.add(hb.block_id)
                if key is not None:
                    self._host_pending.append((hb, *key))
            host_blocks.append(hb)
        if start:
            self.tables[rid] = table[:start]
        else:
            del self.tables[rid]
        self.host_tables[rid] = host_blocks + self.host_tables.get(rid, [])
        self._swapping_out.extend(reversed(moving))
        self._num_registered[rid] = min(self._num_registered.get(rid, 0), start)
        self.link_budget -= len(copies)
        return copies

    def release_swapped_out(self) -> None:
        """The previous step's copies are done: their source blocks may be reused, and the host
        copies become findable (a block freed since then is left out: its slot may be reused)."""
        if self._swapping_out:
            self.device.free(self._swapping_out)
            self._swapping_out = []
        for block, block_hash, token_ids in self._host_pending:
            if block.ref_cnt > 0:
                self.host.register(block, block_hash, token_ids)
        self._host_pending = []
        if self._backed_up:
            # Now cached in the host tier, owned by no one; a block evicted with an expected reuse
            # keeps it there, so both tiers evict in the same order.
            plain = [b for b, k in zip(self._backed_up, self._backed_up_keys, strict=True) if k is None]
            hinted = [(b, k) for b, k in zip(self._backed_up, self._backed_up_keys, strict=True) if k is not None]
            if plain:
                self.host.free(plain)
            if hinted:
                self.host.free([b for b, _ in hinted], [k for _, k in hinted])
            self._backed_up = []
            self._backed_up_keys = []
        self._host_writing.clear()
        if self._host_deferred:
            deferred, self._host_deferred = self._host_deferred, []
            if not self.keyed_reloads:
                self._free_host(deferred)
                return
            # Under keyed eviction, a host block just read back (a swap-in) was used now: keyed as
            # if freed now. Left unkeyed it would be evicted before every keyed block, so the
            # host tier would drop its hottest blocks first.
            self._free_host(deferred, [self.host.now] * len(deferred))

    def _back_up(self, block: KVBlock) -> None:
        if not self._write_backs_open or self.link_budget <= 0:
            return
        copy = self.host.lookup(block.block_hash, block.token_ids)
        if copy is not None:
            if self.keyed_reloads and block.reuse_at is not None:
                self.host.rekey(copy, block.reuse_at)  # the host copy now stands for the block
            return
        if not self.host.num_free_blocks:
            return
        hb = self.host.allocate(1)[0]
        self.link_budget -= 1
        self._back_ups.append((block.block_id, hb.block_id))
        self._host_pending.append((hb, block.block_hash, block.token_ids))
        self._backed_up.append(hb)
        self._backed_up_keys.append(block.reuse_at)

    def take_back_ups(self) -> list[tuple[int, int]]:
        """This step's write-back copies (device, host); the link budget ends with the step."""
        out, self._back_ups = self._back_ups, []
        self.link_budget = 0
        self._write_backs_open = False
        return out

    def swap_in_blocks(self, request: Request, max_blocks: int) -> list[tuple[int, int]]:
        """Bring host blocks back to the device, up to max_blocks copies; returns the (host,
        device) copies. A block the device cache still holds is shared instead of copied (and
        costs no copy), so a step either copies something or moves the whole host part."""
        rid = request.request_id
        host_table = self.host_tables.get(rid, [])
        if self.host is None or not host_table or max_blocks <= 0:
            return []
        copies, new_blocks = [], []
        # The swap-in claims its copies from the link before it allocates: a cached block that an
        # allocation evicts is written back only within what is left after them. The part it
        # does not use is given back below.
        self.link_budget -= max_blocks
        for hb in host_table:
            dev = self.device.lookup(hb.block_hash, hb.token_ids) if hb.block_hash is not None else None
            if dev is not None:
                self.device.touch([dev])
            elif len(copies) < max_blocks and self.device.num_free_blocks:
                dev = self.device.allocate(1)[0]
                copies.append((hb.block_id, dev.block_id))
            else:
                break
            new_blocks.append(dev)
        self.link_budget += max_blocks - len(copies)
        n = len(new_blocks)
        if n == 0:
            return []
        moving = host_table[:n]
        del host_table[:n]
        if not host_table:
            del self.host_tables[rid]
        self.tables[rid] = self.tables.get(rid, []) + new_blocks
        self._host_deferred.extend(reversed(moving))
        return copies

    def _free_host(self, blocks: list[KVBlock], reuse_at: list[float] | None = None) -> None:
        if self._host_writing:
            # Written this step and let go: never published, and free only from the next step.
            late = [b for b in blocks if b.ref_cnt == 1 and b.block_id in self._host_writing]
            if late:
                ids = {b.block_id for b in late}
                self._host_pending = [p for p in self._host_pending if p[0].block_id not in ids]
                self._host_deferred.extend(late)
                keep = [i for i, b in enumerate(blocks) if b.block_id not in ids]
                blocks = [blocks[i] for i in keep]
                reuse_at = [reuse_at[i] for i in keep] if reuse_at is not None else None
        self.host.free(blocks, reuse_at)
