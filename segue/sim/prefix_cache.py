"""Prefix-cache hit rate against capacity: a Mooncake trace replayed through Segue's own
KVCacheManager (segue/kv, the code the real engine runs), device pool alone or with the host tier
behind it, under two eviction orders:

- lru: blocks of finished requests are evicted least recently freed first, tail before head
  (what vLLM and SGLang do, and what KVCacheManager.free does without keys);
- segue: the same pool with ReuseTracker's keys (segue/kv/reuse.py): LRU shifted by each block's
  expected reuse distance, learned online from which chains come back and how soon.

Requests are replayed one at a time in arrival order, each freeing its blocks before the next one
looks up: the capacity is the whole pool acting as a cache (running requests' own blocks are not
subtracted). The maximum is the same replay with a pool that never evicts. One token of the
replay stands for `512 / units_per_block` tokens of the trace, so a cache block is exactly one of
the trace's 512-token hash blocks; hit rates are reported in trace tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from segue.arith import cdiv
from segue.kv.manager import KVCacheManager
from segue.kv.reuse import ReuseTracker
from segue.request import Request
from segue.sampling_params import SamplingParams
from segue.sim.workloads.mooncake import TRACE_BLOCK_TOKENS, MooncakeRequest

EVICTIONS = ("lru", "segue")
# Cache blocks are 16 replay tokens (the engine's default block size) standing for 512 trace tokens.
UNITS_PER_BLOCK = 16
# A big enough copy budget that write-backs are never cut short: this replay measures the policy,
# not the link (the engine's link budget is the simulator's business).
_UNLIMITED_LINK = 1 << 40


@dataclass
class HitRate:
    eviction: str
    device_blocks: int
    host_blocks: int
    query_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    requests: int = 0
    skipped: int = 0   # larger than the device pool: never cached, counted as misses

    @property
    def hit_rate(self) -> float:
        return (self.device_hit_tokens + self.host_hit_tokens) / max(1, self.query_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "hit_rate": self.hit_rate}


@dataclass
class CacheReplay:
    """One pool size and eviction order; feed it requests in arrival order."""
    eviction: str
    device_blocks: int
    host_blocks: int = 0
    units_per_block: int = UNITS_PER_BLOCK
    # Seconds to recompute one block (tie-break of the segue keys; see ReuseTracker.finish).
    block_recompute_s: float = 0.0
    tracker: ReuseTracker = field(default_factory=ReuseTracker)

    def __post_init__(self) -> None:
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {self.eviction!r}")
        self.kv = KVCacheManager(self.units_per_block, self.device_blocks, self.host_blocks)
        self.kv.keyed_reloads = self.eviction == "segue"
        self.result = HitRate(self.eviction, self.device_blocks, self.host_blocks)
        self._params = SamplingParams(max_tokens=1)

    def add(self, i: int, r: MooncakeRequest, check: bool = False) -> None:
        kv, res = self.kv, self.result
        tokens = r.block_tokens(self.units_per_block)
        res.requests += 1
        res.query_tokens += r.input_length
        if cdiv(len(tokens), kv.block_size) > self.device_blocks:
            res.skipped += 1
            return
        now = r.timestamp_s
        kv.set_clock(now)
        req = Request(f"mc{i}", tokens, self._params, now)
        kv.open_link(_UNLIMITED_LINK)
        hit = kv.match_host(req, kv.match(req))
        kv.open_write_backs()
        if hit.num_host_blocks:
            kv.attach_host_hit(req, hit)
            moved = kv.swap_in(req, hit.num_host_blocks)
            if moved.on_host:
                raise AssertionError(f"request {i}: {hit.num_host_blocks - len(moved.copies)} host blocks did not fit")
            grown = kv.allocate_slots(req, len(tokens) - req.num_computed_tokens)
        else:
            grown = kv.allocate_slots(req, len(tokens) - hit.num_tokens, hit)
        if not grown:
            raise AssertionError(f"request {i}: {len(tokens)} tokens do not fit {self.device_blocks} free blocks")
        unit = TRACE_BLOCK_TOKENS // self.units_per_block
        res.device_hit_tokens += hit.num_tokens * unit
        res.host_hit_tokens += hit.num_host_blocks * kv.block_size * unit
        req.num_computed_tokens = len(tokens)
        kv.cache_full_blocks(req)
        kv.take_back_ups()
        kv.release_swapped_out()
        if self.eviction == "lru":
            kv.free(req)
        else:
            full = req.block_hashes[:len(tokens) // kv.block_size]
            cls = self.tracker.admit(full, now)
            keys = self.tracker.finish(full, kv.held(req.request_id).device, cls, now,
                                       self.block_recompute_s)
            kv.free(req, keys)
        # The write-backs that this request's allocations caused are done by the next lookup.
        kv.release_swapped_out()
        if check:
            kv.check_invariants()


def replay_hit_rate(trace: list[MooncakeRequest], eviction: str, device_blocks: int, host_blocks: int = 0,
                    check: bool = False) -> HitRate:
    run = CacheReplay(eviction, device_blocks, host_blocks)
    for i, r in enumerate(trace):
        run.add(i, r, check)
    return run.result


def max_hit_rate(trace: list[MooncakeRequest]) -> HitRate:
    """The same replay with a pool that holds every block the trace ever uses: nothing is evicted."""
    distinct = {h for r in trace for h in r.hash_ids}
    largest = max((len(r.hash_ids) for r in trace), default=1)
    res = replay_hit_rate(trace, "lru", len(distinct) + largest + 1)
    res.eviction = "infinite"
    return res
