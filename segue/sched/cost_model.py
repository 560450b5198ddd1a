"""Measured costs the scheduler reasons with: iteration time T_fwd(tokens), the saturation point,
swap bandwidth and KV bytes per token (InferCept §4). Pure Python, shared with the simulator."""
from __future__ import annotations

import bisect
import itertools
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path


def attended_pairs(start_pos: int, num_tokens: int) -> int:
    """(query, key) pairs a sequence's chunk of `num_tokens` new tokens at position `start_pos`
    attends (causal: the i-th new token sees start_pos + i keys)."""
    return num_tokens * start_pos + num_tokens * (num_tokens + 1) // 2


def scattered_blocks(block_ids: list[int], warmup_blocks: int) -> int:
    """Blocks a decode reads without the hardware prefetchers' help, beyond those of a table in
    one piece. Attention streams a sequence's blocks in the order of their ids; each run of
    consecutive ids is a new memory stream, whose first `warmup_blocks` blocks are read before the
    prefetchers have caught up with it (so one piece costs min(n, warmup) and is the baseline the
    step model already charges)."""
    if warmup_blocks <= 0 or len(block_ids) < 2:
        return 0
    ids = sorted(block_ids)
    cold, run = 0, 1
    for prev, cur in itertools.pairwise(ids):
        if cur == prev + 1:
            run += 1
        else:
            cold += min(run, warmup_blocks)
            run = 1
    cold += min(run, warmup_blocks)
    return cold - min(len(ids), warmup_blocks)


def interpolate_curve(curve: list[list[float]], tokens: float) -> float:
    """A piecewise-linear [[tokens, ms], ...] curve (ascending tokens) at `tokens`: flat below its
    first point, extended with its last segment's slope beyond its last point."""
    xs = [p[0] for p in curve]
    if tokens <= xs[0] or len(curve) == 1:
        return curve[0][1]
    i = min(bisect.bisect_left(xs, tokens), len(curve) - 1)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


@dataclass
class CostModel:
    # T_fwd(tokens) = fwd_ms_per_token * tokens + fwd_base_ms (a linear fit of profiled steps).
    fwd_ms_per_token: float = 0.45
    fwd_base_ms: float = 30.0
    # A profiled curve [[tokens, ms], ...] that replaces the line in T_fwd when present: on a CPU a
    # decode step of 4 sequences costs twice one of 1 while prefill grows linearly, which no single
    # line fits (the marginal cost T_fwd_extra stays the line's slope).
    fwd_curve_ms: list[list[float]] | None = None
    # Attention reads every context token's KV each step; this is its cost per context token
    # (used by the simulator's step time; the scheduler's decisions use T_fwd(tokens)).
    fwd_ms_per_context_token: float = 0.0
    # Prefill attention compares each new token with every earlier one, so a chunk's attention
    # grows with tokens x context, which the context term cannot carry: a 2,048-token chunk over a
    # 3,000-token history attends ~8M (query, key) pairs over 5,000 context tokens. This is the
    # cost of one pair beyond what the context term charges (a decode token's pairs are its
    # context, so for decodes the two terms add up).
    fwd_ms_per_attended_pair: float = 0.0
    # Decode attention over a table in pieces: what one scattered_blocks() block costs (one
    # sequence, all layers), and how many blocks of a new run the prefetchers need to catch up.
    # Under memory pressure a pool hands out blocks freed all over it. On an AMD EPYC
    # (avx512_bf16) a decode step of 4 x 2,048 tokens took 22.1 ms over tables in one piece and
    # 39.3 ms over shuffled ones before the kernel prefetched in software; 21.1 and 22.8 ms after.
    fwd_ms_per_scattered_block: float = 0.0
    prefetch_warmup_blocks: int = 0
    # Tokens per step beyond which an iteration gets slower without getting more useful work done.
    saturation_tokens: int = 256
    # Host<->device copy bandwidth and the KV footprint of one token (all layers, K and V).
    swap_bytes_per_s: float = 8e9
    # Whether swaps run beside the forward pass (a GPU's copy engine) or stall the step (a CPU
    # copies before it: segue/model/kv_tensors.py, KVTensors.start_swaps).
    swaps_overlap_compute: bool = True
    # What a copy beside the forward pass costs (segue/profiler/overlap.py): the forward runs this
    # many times slower while it copies, and the copy moves this many bytes per second (0: at
    # swap_bytes_per_s). A copy engine costs nothing; a CPU thread copying beside a 2-core
    # forward (AMD EPYC) slowed it 1.6-1.8x and copied at 0.3-1.0 GB/s, against 11.5 GB/s before it.
    swap_compute_slowdown: float = 1.0
    swap_bytes_per_s_beside_compute: float = 0.0
    kv_bytes_per_token: int = 46080
    device: str = "cpu"
    source: str = "default"

    def t_fwd(self, tokens: float) -> float:
        """Seconds for an iteration that processes `tokens` tokens."""
        if self.fwd_curve_ms:
            return interpolate_curve(self.fwd_curve_ms, max(tokens, 0.0)) / 1000.0
        return (self.fwd_ms_per_token * max(tokens, 0.0) + self.fwd_base_ms) / 1000.0

    def t_step(self, tokens: float, context_tokens: float, attended_pairs: float,
               scattered: float = 0.0) -> float:
        """Seconds for a step of `tokens` batched tokens attending over `context_tokens` KV
        positions (summed over the batch) in `attended_pairs` (query, key) pairs, its decodes
        reading `scattered` blocks away from the prefetchers: what the simulator charges a step."""
        return self.t_fwd(tokens) + (self.fwd_ms_per_context_token * context_tokens
                                     + self.fwd_ms_per_attended_pair * attended_pairs
                                     + self.fwd_ms_per_scattered_block * scattered) / 1000.0

    def t_fwd_extra(self, tokens: float) -> float:
        """Added iteration time when `tokens` more tokens join a step that runs anyway."""
        return self.fwd_ms_per_token * max(tokens, 0.0) / 1000.0

    def t_prefill(self, tokens: int, start_pos: int = 0) -> float:
        """Added time to prefill `tokens` tokens after `start_pos` cached ones in steps that run
        anyway: their marginal cost plus their attention. What recomputing a context costs: on
        the profiled CPU a 4,096-token history's attention is over 40 % of its recompute."""
        t = max(tokens, 0)
        return self.t_fwd_extra(t) + self.fwd_ms_per_attended_pair * attended_pairs(max(start_pos, 0), t) / 1000.0

    def t_swap(self, tokens: float) -> float:
        return tokens * self.kv_bytes_per_token / self.swap_bytes_per_s

    def overlapped_step(self, compute_s: float, tokens: float) -> tuple[float, float]:
        """(step time, stall) of a step whose `compute_s` of forward pass runs beside a copy of
        `tokens` of KV: while both run the forward is swap_compute_slowdown times slower and the
        copy runs at swap_bytes_per_s_beside_compute; what is left of the copy when the forward
        ends runs alone, at swap_bytes_per_s, and stalls the step."""
        slowdown = max(self.swap_compute_slowdown, 1.0)
        beside = self.swap_bytes_per_s_beside_compute or self.swap_bytes_per_s
        copy_s = tokens * self.kv_bytes_per_token / beside
        if copy_s <= compute_s * slowdown:
            return compute_s + copy_s * (1 - 1 / slowdown), 0.0
        left = tokens * self.kv_bytes_per_token - compute_s * slowdown * beside
        stall = left / self.swap_bytes_per_s
        return compute_s * slowdown + stall, stall

    def scaled(self, factor: float) -> "CostModel":
        """The same model with every compute cost times `factor` (copies unchanged): a device that
        runs its forward passes `factor` times slower than profiled, as a served engine does
        whose cores also run the HTTP frontend (EngineStats: step seconds over modelled, sched/step_charge.py)."""
        if factor <= 0:
            raise ValueError(f"the step-time factor must be positive, got {factor}")
        return replace(self, fwd_ms_per_token=self.fwd_ms_per_token * factor, fwd_base_ms=self.fwd_base_ms * factor,
                       fwd_curve_ms=[[t, ms * factor] for t, ms in self.fwd_curve_ms] if self.fwd_curve_ms else None,
                       fwd_ms_per_context_token=self.fwd_ms_per_context_token * factor,
                       fwd_ms_per_attended_pair=self.fwd_ms_per_attended_pair * factor,
                       fwd_ms_per_scattered_block=self.fwd_ms_per_scattered_block * factor)

    def copy_pays(self, reuse_rate: float, tokens: float) -> bool:
        """Whether copying `tokens` of KV to the host where the copy cannot hide behind compute
        (it stalls the step) saves time: when they are read back with probability `reuse_rate`,
        the copy spares their recompute. On the profiled CPU a copy costs ~1 % of a recompute."""
        return reuse_rate * self.t_fwd_extra(tokens) > self.t_swap(tokens)

    def swap_limit(self, batch_tokens: int) -> int:
        """Tokens whose copy hides behind one iteration of `batch_tokens` (T_swap(N) = T_fwd(B))."""
        return int(self.t_fwd(batch_tokens) * self.swap_bytes_per_s / self.kv_bytes_per_token)

    # ---- waste equations (InferCept eqs. 2 and 4), in byte-seconds -----------------------
    def waste_preserve(self, duration_s: float, context_tokens: float) -> float:
        # Tokens as a float: LAMPS weighs an expected context, not a count of blocks held.
        return duration_s * context_tokens * self.kv_bytes_per_token

    def waste_chunked_discard(self, context_tokens: int, other_tokens: int, running_tokens: int) -> float:
        """Recompute the context in chunks of (saturation - running) tokens, one per iteration;
        the others wait for each chunk's marginal cost and for the context's attention."""
        m = self.kv_bytes_per_token
        chunk = max(1, self.saturation_tokens - running_tokens)
        n = max(1, math.ceil(context_tokens / chunk))
        recompute = self.t_prefill(context_tokens)
        own = recompute * context_tokens * m / 2
        attention = recompute - self.t_fwd_extra(context_tokens)
        others = (n * self.t_fwd_extra(context_tokens / n) + attention) * other_tokens * m
        return own + others

    # ---- persistence ---------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        data = json.loads(Path(path).read_text())
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def mean_cost_model(a: CostModel, b: CostModel, source: str) -> CostModel:
    """The mean of two profiles of the same device taken on the same grid (say, before and after
    a run, when the machine's speed moved in between); saturation point and KV size from `a`."""
    curve = None
    if a.fwd_curve_ms or b.fwd_curve_ms:
        if not (a.fwd_curve_ms and b.fwd_curve_ms) or [p[0] for p in a.fwd_curve_ms] != [p[0] for p in b.fwd_curve_ms]:
            raise ValueError("profiles with different step-time curves cannot be averaged")
        curve = [[p[0], (p[1] + q[1]) / 2] for p, q in zip(a.fwd_curve_ms, b.fwd_curve_ms, strict=True)]
    return CostModel(fwd_ms_per_token=(a.fwd_ms_per_token + b.fwd_ms_per_token) / 2,
                     fwd_base_ms=(a.fwd_base_ms + b.fwd_base_ms) / 2, fwd_curve_ms=curve,
                     fwd_ms_per_context_token=(a.fwd_ms_per_context_token + b.fwd_ms_per_context_token) / 2,
                     fwd_ms_per_attended_pair=(a.fwd_ms_per_attended_pair + b.fwd_ms_per_attended_pair) / 2,
                     fwd_ms_per_scattered_block=(a.fwd_ms_per_scattered_block + b.fwd_ms_per_scattered_block) / 2,
                     prefetch_warmup_blocks=a.prefetch_warmup_blocks,
                     saturation_tokens=a.saturation_tokens,
                     swap_bytes_per_s=(a.swap_bytes_per_s + b.swap_bytes_per_s) / 2,
                     swaps_overlap_compute=a.swaps_overlap_compute,
                     swap_compute_slowdown=(a.swap_compute_slowdown + b.swap_compute_slowdown) / 2,
                     swap_bytes_per_s_beside_compute=(a.swap_bytes_per_s_beside_compute
                                                      + b.swap_bytes_per_s_beside_compute) / 2,
                     kv_bytes_per_token=a.kv_bytes_per_token,
                     device=a.device, source=source)


def _preset(ms_per_token: float, base_ms: float, saturation: int, tokens_swapped_per_step: int,
            layers: int, hidden: int, device: str) -> CostModel:
    """A paper setup: the bandwidth is derived from the tokens it swaps during one saturated step."""
    kv = 2 * layers * hidden * 2  # fp16 K and V
    step_s = (ms_per_token * saturation + base_ms) / 1000.0
    # A100 HBM ~1.5 TB/s: each decode step streams every context token's KV once.
    return CostModel(fwd_ms_per_token=ms_per_token, fwd_base_ms=base_ms, saturation_tokens=saturation,
                     fwd_ms_per_context_token=kv / 1.5e12 * 1000,
                     swap_bytes_per_s=tokens_swapped_per_step * kv / step_s, kv_bytes_per_token=kv,
                     device=device, source="preset")


# InferCept §5 setups, used by the simulator and for what-if runs.
PRESETS: dict[str, CostModel] = {
    "gptj-6b-a100": _preset(0.0463, 10.0, 384, 606, layers=28, hidden=4096, device="A100"),
    "vicuna-13b-2xa100": _preset(0.0279, 15.4, 384, 319, layers=40, hidden=5120, device="2xA100"),
}


def load_preset(preset: str, step_time_scale: float = 1.0) -> CostModel:
    """A preset by name or a `segue profile` JSON, its compute `step_time_scale` times slower
    (`segue sim --step-time-scale`)."""
    if preset in PRESETS:
        cost = PRESETS[preset]
    elif Path(preset).exists():
        cost = CostModel.load(preset)
    else:
        raise SystemExit(f"--preset must be one of {sorted(PRESETS)} or a profile JSON path")
    return cost if step_time_scale == 1.0 else cost.scaled(step_time_scale)
