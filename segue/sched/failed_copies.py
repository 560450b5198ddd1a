"""What a step whose executor failed leaves of its KV copies. Pure Python.

The scheduler decides a step's copies (swap-outs of paused contexts, swap-ins of resumed ones,
write-backs of evicted cached blocks) and changes the block tables at once, as if they had
happened: a swapped-out context's tail is in host blocks from then on. When the executor raises
(a CUDA copy or allocation failing in `start_swaps`, the forward after it), the engine aborts the
step's running requests, but the paused and resuming ones it copied for would keep tables that
point at blocks their data never reached, and read them back as context when they resume.

So a failed step's copies count as never made: write-backs are dropped unpublished, and each
request they carried is cut back to the device blocks before the first one that lost its data
(KVCache.lose_step_copies); its tokens after are computed again, as after a discard. A request
that was waiting for a swap-in and has nothing left on the host queues for compute instead.
Conservative on purpose: the executor cannot say which copies landed before it failed.
"""
from __future__ import annotations

from segue.request import RequestStatus
from segue.sched.output import SchedulerOutput
from segue.sched.state import SchedulerState


def forget_failed_copies(state: SchedulerState, out: SchedulerOutput) -> list[str]:
    """Undo what `out`'s copies promised (see the module docstring); returns the requests cut."""
    if not (out.blocks_to_swap_in or out.blocks_to_swap_out or out.blocks_to_back_up):
        return []
    kv = state.kv
    cut = kv.lose_step_copies(out.blocks_to_swap_in)
    for rid, keep_blocks in cut.items():
        req = state.requests.get(rid)
        if req is None:
            continue
        kv.truncate(req, keep_blocks * kv.block_size)
        if req in state.paused.swapped and not kv.held(rid).host:
            # Nothing left to swap in: the rest is computed like any resumed request's tokens.
            state.paused.swapped.remove(req)
            req.status = RequestStatus.WAITING
            state.waiting.append(req)
    return sorted(cut)
