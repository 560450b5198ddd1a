"""Teacher-forced comparisons of a model variant (dtype, quantization) with its fp32 reference:
greedy agreement at every position of one fixed continuation, and perplexity on a fixed text.
Teacher forcing keeps one early disagreement from cascading into a different continuation."""
from __future__ import annotations

import itertools
import math
import pathlib
import re
from dataclasses import dataclass, field
from types import ModuleType
from unittest import mock

import torch

from segue.arith import cdiv
from segue.config import CacheConfig, ModelLoadConfig
from segue.executor.kernel_plan import KernelPlan
from segue.model.attention import AttentionMetadata, PrefillChunk
from segue.model.checkpoint import LoadedCheckpoint
from segue.model.kv_tensors import KVTensors
from segue.model.llama import LlamaModel
from segue.model.quant import EVERY_BATCH, Quantization


def full_logits(model: LlamaModel, ids: list[int], block_size: int = 16, last_only: bool = False) -> torch.Tensor:
    """fp32 logits [T, V] for every position of `ids` (or [1, V] for the last), one causal
    prefill from position 0."""
    cfg, n = model.config, len(ids)
    blocks = cdiv(n, block_size)
    cache = KVTensors(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, blocks, 0,
                    model.device, model.dtype)
    dev = model.device
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=dev))
    meta.prefills = [PrefillChunk(0, n, 0, torch.arange(blocks, device=dev), None)]
    hidden = model.forward(torch.tensor(ids, device=dev), torch.arange(n, device=dev), meta, cache)
    return model.compute_logits(hidden[-1:] if last_only else hidden).float().cpu()


def greedy_continuation(model: LlamaModel, prompt: list[int], n: int, block_size: int = 16) -> list[int]:
    """The model's greedy continuation: one prefill, then one decode step per token over the cache."""
    return _decode_over_cache(model, prompt, n, None, None, block_size).argmax(-1).tolist()


def agreement(ref: LlamaModel, other: LlamaModel, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """Share of continuation positions where both models pick the same greedy token."""
    same = total = 0
    for prompt, cont in zip(prompts, continuations, strict=True):
        ids = prompt + cont
        start = len(prompt) - 1
        a = full_logits(ref, ids)[start:-1].argmax(-1)
        b = full_logits(other, ids)[start:-1].argmax(-1)
        same += int((a == b).sum())
        total += len(cont)
    return same / total


def perplexity(model: LlamaModel, ids: list[int]) -> float:
    logp = torch.log_softmax(full_logits(model, ids)[:-1], dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()
    return math.exp(float(nll))


def decode_logits(model: LlamaModel, prompt: list[int], forced: list[int], kv_dtype: torch.dtype | None = None,
                  block_size: int = 16) -> torch.Tensor:
    """fp32 logits [len(forced), V]: row i predicts forced[i] from prompt + forced[:i], computed by
    one decode step per token over a paged cache of `kv_dtype` (default: the model's). Unlike
    full_logits, every position reads its context back from the cache, so a cache that stores less
    precision than the model shows here."""
    return _decode_over_cache(model, prompt, len(forced), forced, kv_dtype, block_size)


def _decode_over_cache(model: LlamaModel, prompt: list[int], n: int, forced: list[int] | None,
                       kv_dtype: torch.dtype | None, block_size: int) -> torch.Tensor:
    """fp32 logits [n, V] of one prefill of `prompt` and n - 1 decode steps over a paged cache,
    fed `forced` (teacher forcing) or, without it, each step's own greedy token."""
    cfg, dev = model.config, model.device
    blocks = cdiv(len(prompt) + n, block_size)
    cache = KVTensors(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, blocks, 0, dev,
                    kv_dtype or model.dtype)
    table = torch.arange(blocks, device=dev)
    p = len(prompt)
    meta = AttentionMetadata(slot_mapping=torch.arange(p, device=dev))
    if model.kernels is not None and cfg.head_dim == 64:  # the native paged prefill, as the engine runs it
        meta.prefill_kernel = model.kernels
        meta.prefill_query_start = torch.tensor([0, p])
        meta.prefill_start_pos = torch.tensor([0])
        meta.prefill_block_tables = table[:cdiv(p, block_size)].view(1, -1)
    else:
        meta.prefills = [PrefillChunk(0, p, 0, table[:cdiv(p, block_size)])]
    hidden = model.forward(torch.tensor(prompt, device=dev), torch.arange(p, device=dev), meta, cache)
    rows = [model.compute_logits(hidden[-1:]).float().cpu()]
    for i in range(n - 1):
        pos = p + i
        tok = forced[i] if forced is not None else int(rows[-1].argmax())
        used = cdiv(pos + 1, block_size)
        meta = AttentionMetadata(slot_mapping=torch.tensor([pos], device=dev), num_decodes=1,
                                 decode_blocks=table[:used], decode_context_lens=torch.tensor([pos + 1], device=dev),
                                 decode_kernel=model.kernels)
        if model.kernels is None:
            meta.decode_mask = (torch.arange(used * block_size, device=dev) <= pos).view(1, 1, 1, -1)
        hidden = model.forward(torch.tensor([tok], device=dev), torch.tensor([pos], device=dev), meta, cache)
        rows.append(model.compute_logits(hidden).float().cpu())
    return torch.cat(rows)


# ---------------------------------------------------------------------------------------------------------
# Every combination the kernel plan and the attention plan can pick, measured on real prose the way
# the engine computes it.

PROSE = pathlib.Path(__file__).parent / "data" / "prose" / "alice_chapter1.txt"


def prose() -> str:
    """Chapter I of Alice's Adventures in Wonderland (tests/data/prose/README.md) with its hard line
    wraps joined, one paragraph a line: the text as a model reads it, not as it was typeset."""
    raw = PROSE.read_text(encoding="utf-8")
    return "\n\n".join(" ".join(p.split()) for p in re.split(r"\n\s*\n", raw) if p.strip())


def windows(ids: list[int], count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens spread evenly over `ids` (beginning and end included)."""
    assert count * length <= len(ids), (count, length, len(ids))
    step = (len(ids) - length) // max(count - 1, 1)
    return [ids[i * step:i * step + length] for i in range(count)]


@dataclass(frozen=True)
class PlanChoice:
    """One outcome of plan_kernels (segue/executor/kernel_plan.py) as the numbers see it: the
    compute dtype, the layers' and the LM head's weight formats, and whether the quantized kernels
    take every batch (batch_invariant) or only small ones (decode steps) while larger batches run a
    GEMM over the dequantized weights. `plan` is the KernelPlan that plan_kernels returned for it."""
    dtype: torch.dtype
    layers: Quantization
    head: Quantization
    every_batch: bool
    plan: KernelPlan = field(compare=False, hash=False, repr=False)

    @property
    def id(self) -> str:
        name = f"{str(self.dtype).removeprefix('torch.')}-{self.layers.value}-head_{self.head.value}"
        return name + ("-batch_invariant" if self.every_batch else "")


# The row counts of the kernel tables plan_choices makes up: a quantized format that wins, wins up
# to 16 rows, so decode steps of a few sequences run the quantized kernels and prefill chunks the
# GEMM over the dequantized weights, as on every CPU measured so far.
QUANTIZED_ROWS = 16


def plan_choices(layer_formats: set[str], head_formats: set[str]) -> list[PlanChoice]:
    """Every PlanChoice plan_kernels can make for a checkpoint whose layers `layer_formats` and LM
    head `head_formats` hold exactly (lossless_formats' answer), whatever this machine's kernel
    table says: the plan is run over tables where each dtype is the faster and each quantized
    format wins at small batches or never, under `--quantization auto`, int8 and int4, with and
    without batch_invariant. Generated from the code, so a combination the plan learns to pick
    joins the quality tests by itself."""
    from segue.executor import kernel_plan
    from segue.model import kernel_table as kt

    rows = (1, QUANTIZED_ROWS, 512)

    def times(win: int) -> dict[int, float]:
        return {r: 0.1 if r <= win else 100.0 for r in rows}
    found: dict[PlanChoice, None] = {}
    for fast, slow in itertools.permutations(kt.DTYPES):
        dense = {fast: {r: 1.0 for r in rows}, slow: {r: 2.0 for r in rows}}
        for *layer_wins, head_wins in itertools.product((0, QUANTIZED_ROWS), repeat=len(kt.ALL_QUANTS) + 1):
            table = kt.KernelTable({"cpu": "made up"}, {
                "layers": {**dense, **{q: times(w) for q, w in zip(kt.ALL_QUANTS, layer_wins, strict=True)}},
                "lm_head": {**dense, "int8": times(head_wins)}})
            for quantization, invariant in itertools.product(("auto", "int8", "int4"), (False, True)):
                load = ModelLoadConfig(quantization=quantization, batch_invariant=invariant)
                with mock.patch.object(kt, "kernel_table", lambda *a, t=table, **k: t), \
                        mock.patch.object(kernel_plan, "lossless_formats",
                                          lambda *a: (set(layer_formats), set(head_formats))):
                    plan = kernel_plan.plan_kernels(load, None, torch.device("cpu"), object(), {})  # type: ignore[arg-type]
                # LlamaModel's default head format when the plan names none: int8 under int4 layers.
                head = plan.head_quantization if plan.head_quantization is not None else \
                    Quantization.INT8 if plan.quantization is Quantization.INT4 else plan.quantization
                choice = PlanChoice(plan.dtype, plan.quantization if plan.quantized_rows else Quantization.NONE,
                                    head if plan.head_quantized_rows else Quantization.NONE,
                                    plan.quantized_rows >= EVERY_BATCH, plan)
                found.setdefault(choice)
    order = [Quantization.NONE, Quantization.INT4, Quantization.INT8]
    return sorted(found, key=lambda c: (c.every_batch, c.dtype != torch.float32, order.index(c.layers),
                                        order.index(c.head)))


def engine_logits(ckpt: LoadedCheckpoint, plan: KernelPlan, kernels: ModuleType | None, attention: str,
                  texts: list[list[int]], chunk: int, decodes: int, kv_cache_dtype: str = "auto",
                  block_size: int = 16) -> list[torch.Tensor]:
    """fp32 logits [len(text), V] for every text, row i predicting text[i + 1], computed the way
    the engine computes them: by a ModelExecutor built from `plan` with the attention backend
    `attention` ("auto", "native", "sdpa", "sdpa-mask"), every text in every step, the first
    len - `decodes` tokens of each as chunks of `chunk` (a prefill from position 0, then chunks
    extending the cached context), then one teacher-forced decode step per token. The steps go
    through the executor's own execute(), so each row runs the backend and the kernels the
    executor picks for it; its forward's hidden states are kept and every row's logits taken
    (a step's rows in one call, as a step sampling that many rows would)."""
    from segue.executor.model_executor import ModelExecutor
    from segue.request import Request
    from segue.sampling_params import SamplingParams
    from segue.sched.output import ScheduledSeq, SchedulerOutput

    n = len(texts[0])
    assert all(len(t) == n for t in texts) and 0 < decodes < n
    per_text = cdiv(n, block_size) * block_size
    cache = CacheConfig(block_size=block_size, kv_cache_tokens=len(texts) * per_text, swap_space_tokens=0,
                        kv_cache_dtype=kv_cache_dtype)
    ex = ModelExecutor(ckpt, cache, torch.device("cpu"), plan, kernels, attention)
    model = ex.model
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []
    forward = model.forward

    def keep(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             cache: KVTensors) -> torch.Tensor:
        hidden = forward(input_ids, positions, meta, cache)
        steps.append((meta.slot_mapping.clone(), hidden))
        return hidden
    model.forward = keep  # type: ignore[method-assign]
    requests = [Request(f"text-{i}", t, SamplingParams(temperature=0.0), 0.0) for i, t in enumerate(texts)]
    tables = [list(range(i * per_text // block_size, (i + 1) * per_text // block_size)) for i in range(len(texts))]
    logits = torch.empty(len(texts), n, ckpt.config.vocab_size)
    pos = 0
    while pos < n:
        take = min(chunk, n - decodes - pos) if pos < n - decodes else 1
        # Nothing samples: the tokens to come are the text's, and the logits are taken below.
        ex.execute(SchedulerOutput([ScheduledSeq(r, t[pos:pos + take], pos, table, False)
                                    for r, t, table in zip(requests, texts, tables, strict=True)]))
        slots, hidden = steps.pop()
        with torch.inference_mode():
            out = model.compute_logits(hidden).float()
        # Rows come in the executor's order (by backend): each one's slot names its text and position.
        logits[slots // per_text, slots % per_text] = out
        pos += take
    return list(logits)


@dataclass
class Agreement:
    """A variant's teacher-forced numbers against the reference's over the same texts."""
    agreement: float          # share of positions where both pick the same greedy next token
    decode_agreement: float   # the same over the positions that decode steps computed
    ppl: float
    ppl_ref: float

    @property
    def ppl_ratio(self) -> float:
        return self.ppl / self.ppl_ref

    def __str__(self) -> str:
        return (f"agreement {self.agreement:.2%} (decodes {self.decode_agreement:.2%}), perplexity {self.ppl:.3f} "
                f"against {self.ppl_ref:.3f} ({self.ppl_ratio - 1:+.2%})")


def compare(ref: list[torch.Tensor], other: list[torch.Tensor], texts: list[list[int]], decodes: int) -> Agreement:
    """`decodes`: how many of each text's last tokens engine_logits computed by decode steps (the
    logits predicting the text's last decodes - 1 tokens)."""
    same = [a[:-1].argmax(-1) == b[:-1].argmax(-1) for a, b in zip(ref, other, strict=True)]

    def ppl(logits: list[torch.Tensor]) -> float:
        nll = [-torch.log_softmax(lg[:-1], -1).gather(1, torch.tensor(t[1:]).unsqueeze(1))
               for lg, t in zip(logits, texts, strict=True)]
        return math.exp(float(torch.cat(nll).mean()))
    return Agreement(float(torch.cat(same).float().mean()),
                     float(torch.cat([s[-(decodes - 1):] for s in same]).float().mean()), ppl(other), ppl(ref))
