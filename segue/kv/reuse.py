"""Expected reuse of a finished request's cached blocks, for the eviction order of the prefix cache.

Plain LRU evicts the block freed longest ago. That is right when every block is as likely to be
used again, but in chat and agent traffic it is not: a conversation that already came back once
is far more likely to come back again than a one-off prompt (Mooncake's conversation trace: 48 %
against 25 %), and a prefix shared by many chains (a system prompt) is reused every few hundred
milliseconds. The tracker learns both online and gives each block an expected reuse distance D:

- per chain class (a new chain, or one that continues a finished request's prompt chain: the
  agent identity of a plain client): D = mean return gap / sqrt(P(return)), Laplace-smoothed;
- per block used by several requests: at most its own mean interval between uses, shrunk
  toward the class's D (a shared prefix block is counted once, by its own history, whichever
  chain frees it last; without the shrinkage, blocks reused within one burst, interval 0,
  were protected for ever and cost LRU up to 1.4 points on the synthetic trace).

The eviction key is then "LRU shifted by D": a block freed at t is kept as if freed at t - D
(among equal D this is exactly LRU). The pool evicts the most overdue key first (BlockPool's
hinted blocks with every key in the past), and keys never rise along a table, so a chain's
tail always goes before its head and no cached block outlives the prefix that reaches it.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

NEW, CONTINUED = 0, 1


@dataclass
class _BlockUse:
    first: float
    last: float
    uses: int = 1


@dataclass
class _ClassStats:
    finished: int = 0
    returned: int = 0
    gap_sum_s: float = 0.0

    def reuse_distance(self, prior_gap_s: float) -> float:
        # Laplace smoothing: before any evidence P = 1/2 and the gap is the prior. The square
        # root tempers 1/P: with the full factor a large cache (LRU's horizon already past most
        # gaps) lost up to 0.3 points to LRU on Mooncake's conversation trace (BENCHMARKS.md).
        p = (self.returned + 1) / (self.finished + 2)
        gap = (self.gap_sum_s + prior_gap_s) / (self.returned + 1)
        return gap / math.sqrt(p)


class ReuseTracker:
    """Learns, from the block-hash chains of requests as they are admitted and finish, when each
    cached block is expected back. Bounded: it forgets the least recently used entries beyond
    `max_entries` blocks and chain ends."""

    def __init__(self, prior_gap_s: float = 60.0, max_entries: int = 1 << 20) -> None:
        self.prior_gap_s = prior_gap_s
        self.max_entries = max_entries
        self._blocks: OrderedDict[int, _BlockUse] = OrderedDict()
        # Last full-block hash of each finished prompt chain -> (finish time, its class).
        self._chain_ends: OrderedDict[int, tuple[float, int]] = OrderedDict()
        self._classes = (_ClassStats(), _ClassStats())

    def admit(self, block_hashes: list[int], now: float) -> int:
        """A request with these full-block hashes starts; returns its class (NEW or CONTINUED).
        A prompt that extends a finished request's chain continues that request: its return gap
        is recorded against the class of the request it continues (once per chain end)."""
        cls = NEW
        for h in reversed(block_hashes):
            end = self._chain_ends.pop(h, None)
            if end is not None:
                t_end, prev_cls = end
                stats = self._classes[prev_cls]
                stats.returned += 1
                stats.gap_sum_s += max(0.0, now - t_end)
                cls = CONTINUED
                break
        for h in block_hashes:
            use = self._blocks.get(h)
            if use is None:
                self._blocks[h] = _BlockUse(now, now)
            else:
                use.last = now
                use.uses += 1
                self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_entries:
            self._blocks.popitem(last=False)
        return cls

    def finish(self, block_hashes: list[int], num_table_blocks: int, cls: int, now: float,
               block_recompute_s: float = 0.0) -> list[float]:
        """The request of class `cls` finished; its table of `num_table_blocks` device blocks
        (the first len(block_hashes) of them full and cached) is about to be freed. Returns one
        eviction key per table block, head first, for BlockPool.free (all <= now)."""
        stats = self._classes[cls]
        stats.finished += 1
        if block_hashes:
            self._chain_ends[block_hashes[-1]] = (now, cls)
            self._chain_ends.move_to_end(block_hashes[-1])
            while len(self._chain_ends) > self.max_entries:
                self._chain_ends.popitem(last=False)
        base = stats.reuse_distance(self.prior_gap_s)
        keys: list[float] = []
        n = num_table_blocks
        key = now
        for i in range(n):
            d = base
            use = self._blocks.get(block_hashes[i]) if i < len(block_hashes) else None
            if use is not None and use.uses > 1:
                # Its own mean interval, with the class's distance as one more observation: a
                # block used twice in one burst is not hot for ever after.
                d = min(d, (use.last - use.first + base) / use.uses)
            # The recompute a loss costs (this block and all after it) breaks ties head-first;
            # the running minimum keeps keys non-increasing along the chain.
            key = min(key, now - d + (n - i) * block_recompute_s)
            keys.append(min(key, now))
        return keys

    def reuse_distance(self, cls: int) -> float:
        return self._classes[cls].reuse_distance(self.prior_gap_s)
