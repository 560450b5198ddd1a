"""Memory-waste accounting (InferCept's metric): device KV that produces no token, in GB*s,
split by cause. Measured every step from what actually happened, not from the equations.

The engine records it after each step (it knows the step's time and copies); the scheduler never
reads it, which is why it lives here and not in sched/."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class WasteTotals:
    preserved_idle_gbs: float = 0.0   # KV held on the device by paused requests
    recompute_gbs: float = 0.0        # memory occupied while steps recompute discarded context
    swap_stall_gbs: float = 0.0       # memory occupied while steps wait for copies
    elapsed_s: float = 0.0

    @property
    def total_gbs(self) -> float:
        return self.preserved_idle_gbs + self.recompute_gbs + self.swap_stall_gbs

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d["total_gbs"] = self.total_gbs
        return d


class WasteMeter:
    def __init__(self, kv_bytes_per_token: int, block_size: int) -> None:
        self.block_gb = kv_bytes_per_token * block_size / 1e9
        self.totals = WasteTotals()

    def record_step(self, step_s: float, paused_device_blocks: int, running_device_blocks: int,
                    recompute_tokens: int, batch_tokens: int, swap_stall_s: float) -> None:
        """step_s: wall (or simulated) time of the step; swap_stall_s: the part spent copying
        KV instead of computing. Recompute waste is the recompute share of the step times the
        memory of everything running (the request itself and the others it slows down)."""
        t = self.totals
        t.elapsed_s += step_s
        t.preserved_idle_gbs += step_s * paused_device_blocks * self.block_gb
        if batch_tokens and recompute_tokens:
            share = (step_s - swap_stall_s) * recompute_tokens / batch_tokens
            t.recompute_gbs += share * running_device_blocks * self.block_gb
        t.swap_stall_gbs += swap_stall_s * (running_device_blocks + paused_device_blocks) * self.block_gb
