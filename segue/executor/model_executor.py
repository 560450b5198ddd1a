"""Runs scheduled batches through the torch model over the paged KV cache."""
from __future__ import annotations

import logging
import time
from collections.abc import Collection
from types import ModuleType

import torch

from segue.arith import cdiv
from segue.config import CacheConfig, ConfigError
from segue.executor.base import Executor, SampledToken
from segue.executor.kernel_plan import DTYPES, KernelPlan
from segue.model.attention import AttentionMetadata, PrefillChunk
from segue.model.attention_backends import AttentionBackend, AttentionKind, causal_mask
from segue.model.attention_table import AttentionPlan, plan_attention
from segue.model.fused_ops import FusedOps
from segue.model.fused_table import fused_table
from segue.model.kv_tensors import KVTensors
from segue.model.linear_plan import LinearPlan
from segue.model.llama import LlamaModel
from segue.model.loader import LoadedCheckpoint
from segue.model.sampler import sample
from segue.sched.output import ScheduledSeq, SchedulerOutput
from segue.structured.bitmask import fill_bitmask

logger = logging.getLogger(__name__)

class ModelExecutor(Executor):
    def __init__(self, ckpt: LoadedCheckpoint, cache: CacheConfig, device: torch.device, plan: KernelPlan,
                 kernels: ModuleType | None = None, attention: AttentionPlan | str = "auto") -> None:
        """`kernels`: the native CPU module (segue.model.cpu_kernels), None on CUDA or without a
        compiler; `plan`: the dtype and kernels per batch size (segue.executor.kernel_plan);
        `attention`: the attention backend per kind and length, or a backend's name to plan
        (segue.model.attention_table: "auto" is measured on CPU)."""
        self.device = device
        dtype = self.dtype = plan.dtype
        self.config = ckpt.config
        self.quantization = plan.quantization
        self.plan = plan
        self.kv_dtype = dtype if cache.kv_cache_dtype == "auto" else DTYPES[cache.kv_cache_dtype]
        if self.kv_dtype != dtype and not (dtype == torch.float32 and self.kv_dtype == torch.bfloat16):
            raise ConfigError(f"kv_cache_dtype {cache.kv_cache_dtype} under a {str(dtype).removeprefix('torch.')} "
                              "model: the cache takes the model's dtype, or bfloat16 under float32")
        fused = None
        # Batch-invariant runs keep the native forms: one kernel per op whatever the batch.
        if kernels is not None and device.type == "cpu" and not plan.batch_invariant:
            table = fused_table(ckpt.config, dtype, self.kv_dtype, kernels)
            fused = FusedOps(kernels, table.chosen())
            logger.info("elementwise ops: %s", "; ".join(
                f"{op} " + ", ".join(f"{r}: {f}" for r, f in rows.items()) for op, rows in fused.chosen.items()))
        linears = LinearPlan(plan.quantization, dense_above=plan.quantized_rows, padded_rows=dict(plan.padded_rows),
                             block_rows=plan.block_rows, head_quantization=plan.head_quantization,
                             head_dense_above=plan.head_quantized_rows, head_padded_rows=dict(plan.head_padded_rows),
                             head_block_rows=plan.head_block_rows, weights_memory=plan.weights_memory,
                             block_layout=plan.block_layout, head_block_layout=plan.head_block_layout)
        self.model = LlamaModel(ckpt.config, ckpt.weights, device, dtype, linears, kernels, fused)
        cfg = ckpt.config
        resident = self.model.weight_bytes()
        layers = "GGUF blocks" if plan.block_rows or plan.head_block_rows else f"{plan.quantization.value} layers"
        of_file = f", {resident / ckpt.file_tensor_bytes:.2f}x the file's {ckpt.file_tensor_bytes / 2**20:.0f} MiB " \
            "of tensors" if ckpt.file_tensor_bytes else ""
        logger.info("weights: %.0f MiB in memory (%s, %s%s)", resident / 2**20, str(dtype).removeprefix("torch."),
                    layers, of_file)
        self.block_size = cache.block_size
        block_bytes = KVTensors.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                              cache.block_size, self.kv_dtype)
        if cache.kv_cache_bytes is not None:
            self.num_device_blocks = max(1, cache.kv_cache_bytes // block_bytes)
        else:
            self.num_device_blocks = cache.kv_cache_tokens // cache.block_size
        self.num_host_blocks = cache.swap_space_tokens // cache.block_size
        self.kv_bytes_per_token = block_bytes // cache.block_size
        self.device_name = torch.cuda.get_device_name(device).replace(" ", "-") if device.type == "cuda" else "cpu"
        # Seconds the last step spent copying KV between host and device (swap-stall waste).
        self.last_swap_seconds = 0.0
        self.kv_cache = KVTensors(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cache.block_size,
                                self.num_device_blocks, self.num_host_blocks, device, self.kv_dtype)
        # Requests whose next sampled token should carry its hidden state (want_hidden_states).
        self._hidden_for: frozenset[str] = frozenset()
        self.kernels = kernels
        self.invariant_attention = self._invariant_attention(attention) if plan.batch_invariant else None
        if self.invariant_attention is not None:
            logger.info("attention: batch-invariant, every row through the native %s kernel", self.invariant_attention)
        else:
            self.attention = attention if isinstance(attention, AttentionPlan) else \
                plan_attention(cfg, dtype, self.kv_dtype, device, kernels, attention)
            logger.info("attention: %s", self.attention.describe())
        logger.info("KV cache: %d device blocks (%d tokens, %.0f MiB, %s), %d host blocks",
                    self.num_device_blocks, self.num_device_blocks * cache.block_size,
                    self.num_device_blocks * block_bytes / 2**20, str(self.kv_dtype).removeprefix("torch."),
                    self.num_host_blocks)

    def _invariant_attention(self, attention: AttentionPlan | str) -> str:
        """Batch-invariant runs send every row, decodes included, through one kernel whose sums for
        a row depend only on its position and its sequence's logical KV, never on the other rows,
        the chunking or the block ids; no measured switching between backends. The paged prefill
        kernel where it takes the head layout (a decode is a 1-token chunk; each row walks keys in
        position order, in tiles aligned at position 0 whatever its chunk, and masked keys add
        exact zeros); else the decode kernel, each token a query of its own, summed in position
        order (not block-id order)."""
        cfg = self.config
        if attention not in ("auto", AttentionBackend.NATIVE.value):
            raise ConfigError(f"batch_invariant runs the native attention kernels, not attention backend {attention}")
        assert self.kernels is not None  # _batch_invariant_plan requires them
        group = cfg.num_heads // cfg.num_kv_heads
        if self.kernels.paged_prefill_supports(self.dtype, self.kv_dtype, cfg.head_dim, group):
            return "prefill"
        if group > 16:
            raise ConfigError(f"batch_invariant: no native attention kernel takes {group} query heads per KV head "
                              f"at head size {cfg.head_dim}")
        return "decode"

    def _order(self, seqs: list[ScheduledSeq]) -> list[tuple[ScheduledSeq, AttentionBackend]]:
        """Each sequence with its attention backend, in the row order paged_attention takes:
        decodes, then chunks that run the native prefill kernel (one varlen call), then the rest."""
        decodes = [s for s in seqs if s.num_tokens == 1]
        order: list[tuple[ScheduledSeq, AttentionBackend]] = []
        if decodes:
            context = max(s.start_pos + 1 for s in decodes)
            backend = self.attention.backend(AttentionKind.DECODE, 1, context)
            order += [(s, backend) for s in decodes]
        chunks = []
        for s in seqs:
            if s.num_tokens != 1:
                kind = AttentionKind.EXTEND if s.start_pos else AttentionKind.PREFILL
                chunks.append((s, self.attention.backend(kind, s.num_tokens, s.start_pos)))
        return order + sorted(chunks, key=lambda c: c[1] is not AttentionBackend.NATIVE)

    def _token_rows(self, seqs: list[ScheduledSeq]) -> tuple[list[int], list[int], AttentionMetadata]:
        """Token ids and positions of the step's rows, in `seqs` order, and their cache slots."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq in seqs:
            table = seq.block_table
            for j, tok in enumerate(seq.token_ids):
                pos = seq.start_pos + j
                ids.append(tok)
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
        return ids, positions, AttentionMetadata(slot_mapping=torch.tensor(slots, device=self.device))

    def _invariant_metadata(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Every row through invariant_attention's kernel, in the scheduler's order."""
        ids, positions, meta = self._token_rows(seqs)
        if self.invariant_attention == "prefill":
            self._native_prefill_metadata(meta, seqs)
        else:
            # Each token a decode query over its own prefix: one padded table row per token.
            max_blocks = max(cdiv(s.start_pos + s.num_tokens, self.block_size) for s in seqs)
            tables = []
            for s in seqs:
                table = s.block_table[:max_blocks]
                tables.append(torch.tensor(table + [0] * (max_blocks - len(table))).expand(s.num_tokens, -1))
            meta.num_decodes = len(ids)
            meta.decode_blocks = torch.cat(tables).view(-1)
            meta.decode_context_lens = torch.tensor(positions) + 1
            meta.decode_kernel = self.kernels
            meta.decode_logical_order = True
        return torch.tensor(ids), torch.tensor(positions), meta

    def _build_metadata(self, order: list[tuple[ScheduledSeq, AttentionBackend]]
                        ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids, positions, meta = self._token_rows([s for s, _ in order])
        dev = self.device
        decodes = [s for s, _ in order if s.num_tokens == 1]
        meta.num_decodes = len(decodes)
        if decodes:
            max_blocks = max(cdiv(s.start_pos + 1, bs) for s in decodes)
            padded = [s.block_table[:max_blocks] + [0] * (max_blocks - len(s.block_table[:max_blocks]))
                      for s in decodes]
            meta.decode_blocks = torch.tensor(padded, device=dev).view(-1)
            ctx = torch.tensor([s.start_pos + 1 for s in decodes], device=dev)
            meta.decode_context_lens = ctx
            if order[0][1] is AttentionBackend.NATIVE:
                meta.decode_kernel = self.kernels
            else:
                key_pos = torch.arange(max_blocks * bs, device=dev)
                meta.decode_mask = (key_pos[None, :] < ctx[:, None]).view(len(decodes), 1, 1, -1)
        chunks = order[meta.num_decodes:]
        native = [s for s, b in chunks if b is AttentionBackend.NATIVE]
        if native:
            self._native_prefill_metadata(meta, native)
        row = meta.num_decodes + sum(s.num_tokens for s in native)
        for s, backend in chunks[len(native):]:
            ctx_len = s.start_pos + s.num_tokens
            mask = causal_mask(s.start_pos, s.num_tokens, dev) if backend is AttentionBackend.SDPA_MASK \
                and s.start_pos else None
            block_ids = torch.tensor(s.block_table[:cdiv(ctx_len, bs)], device=dev)
            meta.prefills.append(PrefillChunk(row, row + s.num_tokens, s.start_pos, block_ids, backend, mask))
            row += s.num_tokens
        input_ids = torch.tensor(ids, device=dev)
        pos_t = torch.tensor(positions, device=dev)
        return input_ids, pos_t, meta

    def _native_prefill_metadata(self, meta: AttentionMetadata, prefills: list[ScheduledSeq]) -> None:
        """One varlen call per layer: row offsets, start positions and padded block tables."""
        bs = self.block_size
        starts, tables, max_blocks = [0], [], 0
        for s in prefills:
            starts.append(starts[-1] + s.num_tokens)
            table = s.block_table[:cdiv(s.start_pos + s.num_tokens, bs)]
            tables.append(table)
            max_blocks = max(max_blocks, len(table))
        meta.prefill_kernel = self.kernels
        meta.prefill_query_start = torch.tensor(starts)
        meta.prefill_start_pos = torch.tensor([s.start_pos for s in prefills])
        meta.prefill_block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])

    def want_hidden_states(self, request_ids: Collection[str]) -> bool:
        self._hidden_for = frozenset(request_ids)
        return True

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        hidden_for, self._hidden_for = self._hidden_for, frozenset()
        # Write-backs read blocks that this step's swap-ins and forward pass overwrite: they go
        # first, synchronously, and count as stall; so do a CPU's swaps (KVTensors.start_swaps).
        t0 = time.perf_counter()
        self.kv_cache.back_up(out.blocks_to_back_up)
        swaps = self.kv_cache.start_swaps(out.blocks_to_swap_in, out.blocks_to_swap_out)
        before_s = time.perf_counter() - t0
        try:
            return self._run(out, hidden_for)
        finally:
            # Whatever the copies still need after the forward is a stall (swap waste).
            t0 = time.perf_counter()
            swaps.wait()
            self.last_swap_seconds = time.perf_counter() - t0 + before_s

    def _run(self, out: SchedulerOutput, hidden_for: frozenset[str] = frozenset()) -> dict[str, SampledToken]:
        if not out.seqs:
            return {}
        if self.invariant_attention is not None:
            seqs = out.seqs
            input_ids, positions, meta = self._invariant_metadata(seqs)
        else:
            order = self._order(out.seqs)
            seqs = [s for s, _ in order]
            input_ids, positions, meta = self._build_metadata(order)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_cache)
        rows, sampled_seqs, row = [], [], 0
        for s in seqs:
            row += s.num_tokens
            if s.sample:
                rows.append(row - 1)
                sampled_seqs.append(s)
        if not rows:
            return {}
        last = hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(last)
        # Constrained requests (segue/structured): only rows that sample advance their grammar.
        grammars = [s.request.grammar for s in sampled_seqs]
        allowed = fill_bitmask(grammars, [s.request.output_token_ids for s in sampled_seqs],
                               logits.shape[-1],
                               [s.request.sampling_params.max_tokens - s.request.num_generated_tokens
                                for s in sampled_seqs]) if any(grammars) else None
        results = sample(logits, [s.request.sampling_params for s in sampled_seqs],
                         [s.request.num_output_tokens for s in sampled_seqs], allowed)
        tokens = {s.request.request_id: SampledToken(r.token_id, r.logprob, r.top)
                  for s, r in zip(sampled_seqs, results, strict=True)}
        want = [j for j, s in enumerate(sampled_seqs) if s.request.request_id in hidden_for] if hidden_for else []
        if want:
            # Rows already computed for sampling: the only cost is one small copy to the host.
            states = last[want].float().cpu().numpy()
            for j, state in zip(want, states, strict=True):
                tokens[sampled_seqs[j].request.request_id].hidden = state
        return tokens
