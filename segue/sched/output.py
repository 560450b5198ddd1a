"""What one scheduling step asks the executor to do."""
from __future__ import annotations

from dataclasses import dataclass, field

from segue.arith import cdiv
from segue.request import Request
from segue.sched.cost_model import attended_pairs, scattered_blocks


@dataclass
class ScheduledSeq:
    request: Request
    # Tokens to run this step and the position of the first one.
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    # True when this chunk reaches the end of the known tokens, so a next token is sampled.
    sample: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # Block copies for this step. Executors copy swap-ins before swap-outs: a host block freed by
    # a swap-in may be the destination of a swap-out in the same step. Swapped-out device blocks
    # stay reserved until the next step, so the copies may overlap the forward pass.
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    # Write-back of cached device blocks evicted this step into the host tier (device, host):
    # copied before everything else, since this step's swap-ins or forward pass overwrite them.
    blocks_to_back_up: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def num_context_tokens(self) -> int:
        """KV positions the step attends over, summed over its sequences (the step-cost model's
        context term: segue/sched/cost_model.py)."""
        return sum(s.start_pos + s.num_tokens for s in self.seqs)

    @property
    def num_attended_pairs(self) -> int:
        """(query, key) pairs the step attends, summed over its sequences (the pair term)."""
        return sum(attended_pairs(s.start_pos, s.num_tokens) for s in self.seqs)

    def num_scattered_blocks(self, block_size: int, warmup_blocks: int) -> int:
        """Blocks the step's decodes read away from the prefetchers (the scattered-block term).
        Prefills are left out: a chunk's keys are read once per tile of queries, from the caches
        after the first (on the profiled CPU a 512-token chunk over a 3,500-token history took 3 %
        longer over a shuffled table)."""
        if warmup_blocks <= 0:
            return 0
        return sum(scattered_blocks(s.block_table[:cdiv(s.start_pos + 1, block_size)], warmup_blocks)
                   for s in self.seqs if s.num_tokens == 1)

    @property
    def is_empty(self) -> bool:
        return not (self.seqs or self.blocks_to_swap_in or self.blocks_to_swap_out or self.blocks_to_back_up)
