"""Attention backends chosen by measurement on the machine that runs them.

The native kernels were tuned on one CPU; on a Xeon with AMX, torch's flash kernel (oneDNN brgemm
on AMX tiles) ran 2,048 causal tokens in 20.5 ms where the native tile took 48.1 ms, while on an
AVX512-BF16 EPYC the native tile wins. So at the first start with a model's head layout, every
correct backend of each kind of attention (segue/model/attention_backends.py) is timed at a
ladder of lengths, and the fastest runs per (kind, length range). Cached like the GEMM table
(segue/model/kernel_table.py), under the CPU, thread count, torch, kernels' build and the head
layout, and reused at every start until that key changes; a point where the backends' difference
stayed within the noise of the timing runs the preferred backend (timing.py).
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import torch

from segue.model import table_cache, timing
from segue.model.attention_backends import (
    AttentionBackend,
    AttentionKind,
    causal_mask,
    lse_merge_available,
    sdpa_decode,
    sdpa_extend_lse,
    sdpa_extend_masked,
    sdpa_prefill,
)
from segue.model.config import ModelConfig
from segue.model.kernel_table import cpu_identity
from segue.model.table_cache import MeasuredTable

logger = logging.getLogger(__name__)

TABLE_METHOD = "attention-v2-mixed-decode"
# Decode batches of this many sequences at each context length (agents decode a few at a time).
DECODE_BATCH = 4
# Their lengths, as fractions of the longest: a decode step's batch mixes lengths, and the SDPA
# path pads every sequence to the longest (its mask hides the rest) where the native kernel reads
# each sequence's own blocks. A batch of equal lengths hid that: SDPA's best case, and not the one
# the executor looks the backend up by (its longest context).
DECODE_MIX = (1.0, 0.75, 0.5, 0.25)
DECODE_CONTEXTS = (256, 1024, 4096)
PREFILL_TOKENS = (32, 256, 1024, 2048)
# Extends: new tokens x cached tokens (a tool result or a turn appended to a held history).
EXTEND_TOKENS = (16, 128, 512)
EXTEND_CACHED = (512, 4096)
BLOCK = 16


@dataclass(frozen=True)
class HeadLayout:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_dtype: torch.dtype

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype) -> HeadLayout:
        return cls(config.num_heads, config.num_kv_heads, config.head_dim, dtype, kv_dtype)


def candidates(kind: AttentionKind, layout: HeadLayout, kernels: ModuleType | None,
               device: torch.device) -> tuple[AttentionBackend, ...]:
    """The correct backends for `kind` at this layout, the preferred one on a tie first (native:
    it reads blocks in place, with no gathered copy)."""
    out: list[AttentionBackend] = []
    if kernels is not None and device.type == "cpu":
        if kind is AttentionKind.DECODE:
            native = layout.group <= 16
        else:
            native = kernels.paged_prefill_supports(layout.dtype, layout.kv_dtype, layout.head_dim, layout.group)
        if native:
            out.append(AttentionBackend.NATIVE)
    out.append(AttentionBackend.SDPA)
    if kind is AttentionKind.EXTEND:
        if not lse_merge_available(device):
            out.remove(AttentionBackend.SDPA)
        out.append(AttentionBackend.SDPA_MASK)
    return tuple(out)


def point(kind: AttentionKind, new_tokens: int, context: int) -> str:
    """The ladder point a call of `new_tokens` rows over `context` cached tokens is timed at."""
    if kind is AttentionKind.DECODE:
        return str(timing.bucket(DECODE_CONTEXTS, context))
    if kind is AttentionKind.PREFILL:
        return str(timing.bucket(PREFILL_TOKENS, new_tokens))
    return f"{timing.bucket(EXTEND_TOKENS, new_tokens)}/{timing.bucket(EXTEND_CACHED, context)}"


@dataclass
class AttentionTable(MeasuredTable):
    # kind -> backend -> point -> ms per layer call
    timings_ms: dict[str, dict[str, dict[str, float]]]

    def winners(self) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for kind, by_backend in self.timings_ms.items():
            default = next(iter(by_backend))  # candidates() lists the preferred one first
            points = next(iter(by_backend.values()))
            out[kind] = {p: timing.pick({b: ms[p] for b, ms in by_backend.items()}, default, self.ratios_at(kind, p))
                         for p in points}
        return out

    def format(self) -> str:
        lines = [f"attention (ms per layer){' — measured on a noisy machine' if self.noisy else ''}"]
        for kind, by_backend in self.timings_ms.items():
            win = self.winners()[kind]
            lines.append(f"  {kind:<8}" + "".join(f"{b:>11}" for b in by_backend) + "   chosen")
            for p in next(iter(by_backend.values())):
                cells = "".join(f"{by_backend[b][p]:11.3f}" for b in by_backend)
                lines.append(f"  {p:<8}" + cells + "   " + win[p])
        return "\n".join(lines)


@dataclass
class AttentionPlan:
    """Which backend each kind of attention runs, per ladder point; a kind the plan has no
    measurement for runs its first candidate (CUDA, or a forced backend)."""
    defaults: dict[AttentionKind, AttentionBackend]
    chosen: dict[str, dict[str, str]] = field(default_factory=dict)

    def backend(self, kind: AttentionKind, new_tokens: int, context: int) -> AttentionBackend:
        by_point = self.chosen.get(kind.value)
        if by_point:
            return AttentionBackend(by_point.get(point(kind, new_tokens, context), self.defaults[kind].value))
        return self.defaults[kind]

    def describe(self) -> str:
        if not self.chosen:
            return ", ".join(f"{k.value} {b.value}" for k, b in self.defaults.items())
        return "; ".join(f"{kind} " + ", ".join(f"{p}: {b}" for p, b in pts.items())
                         for kind, pts in self.chosen.items())


def plan_attention(config: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device,
                   kernels: ModuleType | None, backend: str = "auto") -> AttentionPlan:
    """`backend` "auto": measured on CPU (cached), the preferred candidate elsewhere; a backend's
    name: that one wherever it is correct, the preferred candidate where it is not."""
    layout = HeadLayout.of(config, dtype, kv_dtype)
    cands = {kind: candidates(kind, layout, kernels, device) for kind in AttentionKind}
    if backend != "auto":
        forced = AttentionBackend(backend)
        return AttentionPlan({k: forced if forced in c else c[0] for k, c in cands.items()})
    defaults = {k: c[0] for k, c in cands.items()}
    if device.type != "cpu" or all(len(c) == 1 for c in cands.values()):
        return AttentionPlan(defaults)
    table = attention_table(layout, kernels, device)
    return AttentionPlan(defaults, table.winners())


def table_key(layout: HeadLayout, kernels: ModuleType | None) -> dict[str, str]:
    return {**cpu_identity(), "method": TABLE_METHOD, "threads": str(torch.get_num_threads()),
            "torch": torch.__version__, "kernels": getattr(kernels, "__name__", "none"),
            "heads": f"{layout.num_heads}/{layout.num_kv_heads}x{layout.head_dim}",
            "dtype": str(layout.dtype).removeprefix("torch."), "kv_dtype": str(layout.kv_dtype).removeprefix("torch.")}


def attention_table(layout: HeadLayout, kernels: ModuleType | None, device: torch.device,
                    remeasure: bool = False) -> AttentionTable:
    key = table_key(layout, kernels)
    return table_cache.cached_table("attention", key, AttentionTable,
                                    lambda stale: measure(layout, kernels, device, key), remeasure=remeasure)


def measure(layout: HeadLayout, kernels: ModuleType | None, device: torch.device,
            key: dict[str, str]) -> AttentionTable:
    """Time each kind's candidates on random Q/K/V of the model's head layout over a shuffled
    paged cache (block order matters to the native kernels' prefetching)."""
    busy: list[str | None] = [timing.machine_busy()]
    gen = torch.Generator().manual_seed(0)
    nh, kvh, hd, scale = layout.num_heads, layout.num_kv_heads, layout.head_dim, layout.head_dim ** -0.5
    longest = max(DECODE_BATCH * DECODE_CONTEXTS[-1], PREFILL_TOKENS[-1], EXTEND_TOKENS[-1] + EXTEND_CACHED[-1])
    num_blocks = -(-longest // BLOCK) + 1
    kc = torch.randn(kvh, num_blocks, BLOCK, hd, generator=gen).to(layout.kv_dtype)
    vc = torch.randn(kvh, num_blocks, BLOCK, hd, generator=gen).to(layout.kv_dtype)
    order = torch.randperm(num_blocks, generator=gen)

    def table_of(tokens: int) -> torch.Tensor:
        return order[:-(-tokens // BLOCK)]

    def decode_batch(longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded block tables [DECODE_BATCH * max_blocks] of a batch whose lengths mix as
        DECODE_MIX does, each sequence on blocks of its own, and the lengths."""
        lens = [max(1, int(longest * f)) for f in DECODE_MIX]
        width = -(-longest // BLOCK)
        tables, used = [], 0
        for n in lens:
            own = order[used:used + -(-n // BLOCK)].tolist()
            used += len(own)
            tables.append(own + [0] * (width - len(own)))  # the executor pads with block 0 too
        return torch.tensor(tables).view(-1), torch.tensor(lens)

    def qkv(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randn(rows, nh, hd, generator=gen).to(layout.dtype)
        k = torch.randn(rows, kvh, hd, generator=gen).to(layout.dtype)
        return q, k, torch.randn(rows, kvh, hd, generator=gen).to(layout.dtype)

    def native_prefill(q: torch.Tensor, start: int, blocks: torch.Tensor) -> Callable[[], object]:
        assert kernels is not None
        return functools.partial(kernels.paged_prefill_attention, q, kc, vc, torch.tensor([0, q.shape[0]]),
                                 torch.tensor([start]), blocks[None], scale)

    def calls(kind: AttentionKind, n: int, cached: int) -> dict[str, Callable[[], object]]:
        out: dict[str, Callable[[], object]] = {}
        q, k, v = qkv(DECODE_BATCH if kind is AttentionKind.DECODE else n)
        for b in candidates(kind, layout, kernels, device):
            if kind is AttentionKind.DECODE:
                blocks, lens = decode_batch(cached)
                if b is AttentionBackend.NATIVE:
                    assert kernels is not None
                    out[b.value] = functools.partial(kernels.paged_decode_attention, q, kc, vc,
                                                     blocks.view(DECODE_BATCH, -1), lens, scale)
                else:
                    # As the executor builds it: padded to the longest, the padding masked off.
                    key_pos = torch.arange(blocks.numel() // DECODE_BATCH * BLOCK)
                    mask = (key_pos[None, :] < lens[:, None]).view(DECODE_BATCH, 1, 1, -1)
                    out[b.value] = functools.partial(sdpa_decode, q, kc, vc, blocks, mask, scale)
            elif b is AttentionBackend.NATIVE:
                out[b.value] = native_prefill(q, cached, table_of(cached + n))
            elif kind is AttentionKind.PREFILL:
                out[b.value] = functools.partial(sdpa_prefill, q, k, v, scale)
            elif b is AttentionBackend.SDPA:
                out[b.value] = functools.partial(sdpa_extend_lse, q, k, v, kc, vc, table_of(cached + n), cached, scale)
            else:
                out[b.value] = functools.partial(sdpa_extend_masked, q, kc, vc, table_of(cached + n), cached, scale,
                                                 causal_mask(cached, n, device))
        return out

    ladders: dict[AttentionKind, list[tuple[str, int, int]]] = {
        AttentionKind.DECODE: [(str(c), 1, c) for c in DECODE_CONTEXTS],
        AttentionKind.PREFILL: [(str(n), n, 0) for n in PREFILL_TOKENS],
        AttentionKind.EXTEND: [(f"{n}/{c}", n, c) for n in EXTEND_TOKENS for c in EXTEND_CACHED],
    }
    t0 = time.perf_counter()
    timings: dict[str, dict[str, dict[str, float]]] = {}
    ratios: dict[str, dict[str, timing.Ratios]] = {}
    unstable: list[str] = []
    for kind, ladder in ladders.items():
        names = [b.value for b in candidates(kind, layout, kernels, device)]
        by_backend: dict[str, dict[str, float]] = {b: {} for b in names}
        ratios[kind.value] = {}
        for name, n, cached in ladder:
            # Each backend against the preferred one (listed first), the only comparison decided.
            result = timing.time_candidates({b: [call] for b, call in calls(kind, n, cached).items()},
                                            pairs=[(b, names[0]) for b in names[1:]])
            if not result.stable:
                unstable.append(f"{kind.value} {name}")
            busy.append(result.busy)
            ratios[kind.value][name] = result.ratios
            for b, ms in result.ms.items():
                by_backend[b][name] = ms
        timings[kind.value] = by_backend
    noisy = timing.report("attention table", timing.first(busy), unstable, time.perf_counter() - t0)
    return AttentionTable(key, timings, noisy, ratios)
