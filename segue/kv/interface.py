"""What the scheduler may know of the KV cache: the verbs of `KVCache` and the plain or opaque
values they trade in. The only part of segue/kv that modules outside it import (besides the
places that construct a KVCacheManager: the engine's scheduler builder, the simulator, tests),
so that pools, block tables and blocks can change shape behind it (vLLM's KVCacheBlocks plays
this part between its scheduler and KV manager; SGLang's radix cache offers match / insert /
lock / evict).

The verbs, by what they are for:
- read: counters() (pool sizes, free blocks, the host link), held() / holders() (who holds
  what), num_private_blocks_of(), block_ids(), num_blocks_needed(), num_freed_by_release();
- match a prefix: match() (device), match_host() (its continuation in the host tier);
- allocate: allocate_slots() (with a match attached), attach_host_hit(), cache_full_blocks();
- give memory back: free() (preemption, discard), finish() (a finished request, keyed by its
  expected reuse), release() (a paused context, kept findable), truncate(); pin and unpin an
  agent's history: retain() / release_retained();
- move between the tiers: begin_step(), open_link(), open_write_backs(), swap_out(),
  swap_in(), take_back_ups(); and when a step's copies failed, lose_step_copies().
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from segue.kv.block_pool import KVBlock, num_private_tail
from segue.request import Request

# (source block id, destination block id) pairs for the executor to copy.
Copies = list[tuple[int, int]]


@dataclass(frozen=True, eq=False)
class PrefixHit:
    """A request's cached prefix (KVCache.match, match_host): opaque to the scheduler, which
    reads its sizes and hands it back to allocate_slots() or attach_host_hit()."""
    _device: tuple[KVBlock, ...] = ()
    _host: tuple[KVBlock, ...] = ()
    block_size: int = 1

    @property
    def num_blocks(self) -> int:
        """Device blocks hit."""
        return len(self._device)

    @property
    def num_tokens(self) -> int:
        """Tokens the device hits hold (whole blocks)."""
        return len(self._device) * self.block_size

    @property
    def num_host_blocks(self) -> int:
        """Host-tier blocks that continue the device hits (after match_host)."""
        return len(self._host)

    @property
    def block_ids(self) -> list[int]:
        """The device hits' block ids, head first."""
        return [b.block_id for b in self._device]

    def num_free(self) -> int:
        """Device hits that sit in the free list now: taking them takes free blocks (read at
        each decision: releases and allocations change it)."""
        return sum(1 for b in self._device if b.ref_cnt == 0)


NO_HIT = PrefixHit()


@dataclass(eq=False)
class RetainedContext:
    """An agent's history held on the device after its request finished (KVCache.retain): one
    reference on each of its cached blocks, head first, until release_retained()."""
    blocks: list[KVBlock]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def num_private_blocks(self) -> int:
        """Blocks that releasing the handle frees: those no running request or other handle holds
        (a shared system prompt stays)."""
        return num_private_tail(self.blocks)


class Held(NamedTuple):
    """A request's blocks: its device table and the host part that continues it."""
    device: int
    host: int


class Moved(NamedTuple):
    """One swap of a request's context (KVCache.swap_out, swap_in)."""
    copies: Copies   # what the executor copies (a block the other tier still holds moves without one)
    blocks: int      # blocks the request's context moved between the tiers
    on_host: int     # its host blocks after the move


@dataclass(frozen=True)
class KVCounters:
    """The pools and the host link at one moment (KVCache.counters); all 0 without a host tier."""
    num_blocks: int
    num_free_blocks: int
    num_host_blocks: int
    num_free_host_blocks: int
    # Device blocks whose copy to the host is in flight: used until the next step.
    num_swapping_out_blocks: int
    # Blocks the host link may still copy in this step (open_link).
    link_budget: int
    # Measured chance that a block written back to the host is read back (0 without a tier).
    write_back_reuse_rate: float

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_used_host_blocks(self) -> int:
        return self.num_host_blocks - self.num_free_host_blocks

    @property
    def has_host_tier(self) -> bool:
        return self.num_host_blocks > 0


class KVCache(Protocol):
    """The verbs the scheduler may call (implemented by KVCacheManager)."""
    block_size: int

    # ---- read ---------------------------------------------------------------------------
    def counters(self) -> KVCounters: ...
    def held(self, request_id: str) -> Held: ...
    def holders(self, on_host: bool = False) -> list[str]:
        """The requests that hold device blocks (on_host: host blocks)."""
        ...
    def num_private_blocks_of(self, request_id: str) -> int:
        """The tail of a request's device table that no one else holds: what swapping or dropping it frees."""
        ...
    def private_device_tokens(self, request: Request) -> int:
        """Computed tokens in the request's private device blocks: what a disposition acts on."""
        ...
    def block_ids(self, request_id: str) -> list[int]: ...
    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int: ...
    def num_freed_by_release(self, request_ids: list[str], handles: list[RetainedContext],
                             hit: PrefixHit) -> int: ...
    def num_held_blocks(self) -> int: ...
    def check_invariants(self) -> None: ...

    # ---- match and allocate -------------------------------------------------------------
    def full_block_hashes(self, request: Request) -> list[int]: ...
    def match(self, request: Request) -> PrefixHit: ...
    def match_host(self, request: Request, hit: PrefixHit) -> PrefixHit: ...
    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool: ...
    def attach_host_hit(self, request: Request, hit: PrefixHit) -> None: ...
    def cache_full_blocks(self, request: Request) -> None: ...

    # ---- give memory back ---------------------------------------------------------------
    def use_reuse_eviction(self, on: bool) -> None: ...
    def free(self, request: Request) -> None: ...
    def finish(self, request: Request, now: float, block_recompute_s: float) -> None: ...
    def release(self, request: Request, reuse_at: float | None = None, block_recompute_s: float = 0.0) -> None: ...
    def truncate(self, request: Request, num_tokens: int) -> None: ...
    def retain(self, request: Request) -> RetainedContext | None: ...
    def release_retained(self, handle: RetainedContext) -> int: ...

    # ---- the step and the host link -----------------------------------------------------
    def begin_step(self, now: float) -> None: ...
    def open_link(self, blocks: int) -> None: ...
    def open_write_backs(self, past_budget: bool = False) -> None: ...
    def swap_out(self, request: Request, max_blocks: int) -> Moved: ...
    def swap_in(self, request: Request, max_blocks: int) -> Moved: ...
    def take_back_ups(self) -> Copies: ...
    def lose_step_copies(self, swap_in: Copies) -> dict[str, int]: ...
