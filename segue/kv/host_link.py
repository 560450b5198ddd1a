"""The host link's per-step budget, and what became of the blocks written back over it. Kept
apart from the host tier (segue/kv/host_tier.py) because a manager without host memory still
opens and closes the link each step."""
from __future__ import annotations

from dataclasses import dataclass, field

from segue.kv.block_pool import KVBlock


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
