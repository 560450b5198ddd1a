"""What a step costs by the cost model: the simulator's clock advances by it (SimExecutor), and a
real engine sums it beside its measured step times (EngineStats.modelled_step_seconds), so the
profile's error on the traffic actually served is known."""
from __future__ import annotations

from segue.sched.cost_model import CostModel
from segue.sched.output import SchedulerOutput


def step_seconds(cost: CostModel, out: SchedulerOutput, block_size: int) -> tuple[float, float]:
    """(step time, swap stall) of one batch. Where the device has a copy engine, swaps run beside
    the forward pass (InferCept's pipelined swap) and only what outlasts it stalls the step; a copy
    that slows the forward (CostModel.overlapped_step) charges that too. A CPU's swaps, and a step
    with copies but no sequences, have no compute to hide behind, so all their copying is stall."""
    # Write-backs run before the step, synchronously (ModelExecutor.execute: the step's own
    # writes may overwrite the blocks they read), so they never hide behind compute.
    backed_up = cost.t_swap(len(out.blocks_to_back_up) * block_size)
    copied = (len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out)) * block_size
    if not out.seqs:
        stall = backed_up + cost.t_swap(copied)
        return stall, stall
    scattered = out.num_scattered_blocks(block_size, cost.prefetch_warmup_blocks)
    compute = cost.t_step(out.num_batched_tokens, out.num_context_tokens, out.num_attended_pairs, scattered)
    if not cost.swaps_overlap_compute:
        stall = backed_up + cost.t_swap(copied)
        return compute + stall, stall
    step, stall = cost.overlapped_step(compute, copied) if copied else (compute, 0.0)
    return step + backed_up, stall + backed_up
