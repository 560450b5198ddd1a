"""The host-tier side of KVCacheManager (manager.py): the host pool's queries, each request's host
part, host-tier prefix hits, and the per-step link that swaps and write-backs share. Without a
host tier every query reads 0 and nothing moves."""
from __future__ import annotations

from segue.kv.block_pool import BlockPool, KVBlock
from segue.kv.host_tier import HostLink, HostTier
from segue.kv.interface import Copies, Moved, PrefixHit
from segue.request import Request


class HostTierSide:
    """Mixed into KVCacheManager, which sets these attributes."""
    _tier: HostTier | None
    _link: HostLink
    host: BlockPool | None
    enable_prefix_caching: bool

    @property
    def host_tables(self) -> dict[str, list[KVBlock]]:
        """Each request's host blocks, which continue its device table (empty without a host tier)."""
        return self._tier.tables if self._tier is not None else {}

    @property
    def keyed_reloads(self) -> bool:
        """Whether host blocks read back are keyed for eviction (HostTier.keyed_reloads)."""
        return self._tier is not None and self._tier.keyed_reloads

    @keyed_reloads.setter
    def keyed_reloads(self, on: bool) -> None:
        if self._tier is not None:
            self._tier.keyed_reloads = on

    # ---- queries: the host pool and its link (all 0 without a tier) ----------------------
    @property
    def has_host_tier(self) -> bool: return self.host is not None
    @property
    def num_host_blocks(self) -> int: return self.host.num_blocks if self.host is not None else 0
    @property
    def num_free_host_blocks(self) -> int: return self.host.num_free_blocks if self.host is not None else 0
    @property
    def num_used_host_blocks(self) -> int: return self.host.num_used_blocks if self.host is not None else 0

    @property
    def num_swapping_out_blocks(self) -> int:
        """Device blocks whose copy to the host is in flight: used until the next step."""
        return len(self._tier.swapping_out) if self._tier is not None else 0

    @property
    def link_budget(self) -> int:
        """Blocks the host link may still copy in this step (open_link)."""
        return self._link.budget

    # ---- queries: one request's host part -----------------------------------------------
    def request_ids_on_host(self) -> list[str]:
        """The requests that hold host blocks."""
        return list(self.host_tables)

    def num_host_blocks_of(self, request_id: str) -> int:
        return len(self.host_tables.get(request_id, ()))

    def has_host_blocks(self, request_id: str) -> bool:
        """Whether part of the request's context is on the host (a host table is never empty)."""
        return request_id in self.host_tables

    # ---- prefix cache ---------------------------------------------------------------------
    def match_host(self, request: Request, hit: PrefixHit) -> PrefixHit:
        """`hit` (from match) with the host-tier blocks that continue it."""
        if self._tier is None or not self.enable_prefix_caching:
            return hit
        return PrefixHit(hit._device, tuple(self._tier.lookup_hits(request, hit.num_blocks)), hit.block_size)

    # ---- swapping (HostTier; without host memory nothing moves) --------------------------
    def open_link(self, blocks: int) -> None:
        """A step begins: its copies may move `blocks` blocks in all. Write-backs wait for
        open_write_backs(), so that the swaps planned first take their share before them."""
        self._link.open(blocks)

    def open_write_backs(self, past_budget: bool = False) -> None:
        """Cached device blocks evicted from now on are written back within what is left, or
        also past it (stalling the step for the copy) with `past_budget`."""
        self._link.write_backs_open = True
        self._link.write_backs_past_budget = past_budget

    def write_back_reuse_rate(self) -> float:
        """Measured chance that a block written back to the host is read back (0 without a tier)."""
        return self._tier.write_backs.reuse_rate() if self._tier is not None else 0.0

    @property
    def num_stalled_write_backs(self) -> int:
        """Write-backs copied past the link budget so far (each stalled its step)."""
        return self._tier.num_stalled_write_backs if self._tier is not None else 0

    def swap_out(self, request: Request, max_blocks: int) -> Moved:
        """Move up to max_blocks of the request's private device tail to the host; the copies
        are (device, host) pairs (HostTier.swap_out)."""
        if self._tier is None:
            return Moved([], 0, 0)
        before = self.num_host_blocks_of(request.request_id)
        copies = self._tier.swap_out(request, max_blocks)
        after = self.num_host_blocks_of(request.request_id)
        return Moved(copies, after - before, after)

    def swap_in(self, request: Request, max_blocks: int) -> Moved:
        """Bring host blocks back to the device, up to max_blocks copies; the copies are (host,
        device) pairs (HostTier.swap_in)."""
        if self._tier is None:
            return Moved([], 0, 0)
        before = self.num_host_blocks_of(request.request_id)
        copies = self._tier.swap_in(request, max_blocks)
        after = self.num_host_blocks_of(request.request_id)
        return Moved(copies, before - after, after)

    def release_swapped_out(self) -> None:
        """The previous step's copies are done (HostTier.release_swapped_out)."""
        if self._tier is not None:
            self._tier.release_swapped_out()

    def take_back_ups(self) -> Copies:
        """This step's write-back copies (device, host); the link budget ends with the step."""
        out = self._tier.take_back_ups() if self._tier is not None else []
        self._link.close()
        return out
