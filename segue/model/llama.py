"""Llama-family decoder forward over a paged KV cache (Llama 2/3, SmolLM2, Qwen2, Mistral).

Weights are plain tensors (or weight-only quantized LinearWeights, or a GGUF file's blocks in
BlockLinear), not nn.Modules: the forward
is a short list of fused matmuls, and keeping it flat keeps the per-layer Python overhead low,
which matters for a 135M model on CPU. On CPU the elementwise steps run as native fused ops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import cast

import torch

from segue.model.attention import AttentionMetadata, paged_attention
from segue.model.checkpoint import Weight
from segue.model.config import ModelConfig
from segue.model.cpu_kernels import load_gguf_kernels
from segue.model.fused_ops import FusedOps, Rope
from segue.model.gguf_blocks import BlockEmbedding, BlockLayout, BlockLinear, GGMLBlocks, WeightsMemory, concat_rows
from segue.model.kv_tensors import KVTensors
from segue.model.linear_plan import LinearPlan
from segue.model.quant import LinearWeights, Quantization

# A linear layer as the forward calls it: `lin(x)`, with `nbytes` resident.
Linear = LinearWeights | BlockLinear


def _rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        # Llama 3.1 wavelength-dependent scaling.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif scaling.get("rope_type", scaling.get("type")) == "linear":
        inv_freq = inv_freq / scaling["factor"]
    return inv_freq


# Dense weights in the compute dtype: the plan when none is given.
UNQUANTIZED = LinearPlan()


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class LlamaModel:
    """`plan`: how the linear layers and the LM head run (model/linear_plan.py). `kernels`: the
    native CPU module (segue.model.cpu_kernels) for the fused elementwise ops and quantized
    matmuls, or None for the torch forms (CUDA, or no compiler)."""

    def __init__(self, config: ModelConfig, weights: dict[str, Weight], device: torch.device, dtype: torch.dtype,
                 plan: LinearPlan = UNQUANTIZED, kernels: ModuleType | None = None,
                 fused: FusedOps | None = None) -> None:
        quantization = plan.quantization
        self.config = config
        self.device = device
        self.dtype = dtype
        self.quantization = quantization
        self.kernels = kernels
        # The elementwise ops' forms per row count (measured: segue/model/fused_table.py); native
        # everywhere when not given.
        self.ops = fused if fused is not None else FusedOps(kernels) if kernels is not None else None

        def w(name: str) -> torch.Tensor:
            t = weights[name]
            assert isinstance(t, torch.Tensor), f"{name}: norms, biases and dense embeddings are never blocks"
            return t.to(device=device, dtype=dtype).contiguous()

        gguf = load_gguf_kernels() if any(isinstance(t, GGMLBlocks) for t in weights.values()) else None
        keep_dense = plan.weights_memory == WeightsMemory.DENSE.value

        def linear(parts: list[Weight], bias: torch.Tensor | None = None) -> Linear:
            if all(isinstance(t, GGMLBlocks) for t in parts):
                assert gguf is not None  # the loader keeps blocks only where the kernels are built
                return BlockLinear(concat_rows(cast(list[GGMLBlocks], parts)), bias, dtype, gguf, plan.block_rows,
                                   keep_dense, layout=BlockLayout(plan.block_layout))
            # Quantize from the checkpoint's own precision, not from a rounded compute-dtype copy.
            weight = torch.cat([dense(t) for t in parts]) if len(parts) > 1 else dense(parts[0])
            return LinearWeights(weight.to(device), bias, quantization, dtype, kernels, plan.dense_above,
                                 plan.padded_rows)

        def dense(t: Weight) -> torch.Tensor:
            # A file may keep one kind of tensor in a format the kernels do not read (Q3_K ...).
            return t.dequantize(torch.float32, gguf) if isinstance(t, GGMLBlocks) else t

        def raw(name: str) -> Weight:
            return weights[name]

        embed = raw("model.embed_tokens.weight")
        self.embed_tokens: torch.Tensor | BlockEmbedding = BlockEmbedding(embed, dtype, gguf) \
            if isinstance(embed, GGMLBlocks) else w("model.embed_tokens.weight")
        head = raw("model.embed_tokens.weight") if config.tie_word_embeddings else raw("lm_head.weight")
        # int4 keeps the LM head in int8, as llama.cpp's Q4 files keep it in 6-8 bits: 4 bits
        # there cost the default model ~19% of its greedy agreement with fp32 (measured), for a
        # sixth fewer weight bytes per step.
        head_quant: Quantization = Quantization.INT8 if quantization is Quantization.INT4 else quantization
        if plan.head_quantization is not None:
            head_quant = plan.head_quantization
        self.lm_head: Linear = BlockLinear([head], None, dtype, gguf, plan.head_block_rows, keep_dense, fp32_out=True,
                                           layout=BlockLayout(plan.head_block_layout)) \
            if isinstance(head, GGMLBlocks) and gguf is not None else \
            LinearWeights(dense(head).to(device), None, head_quant, dtype, kernels, plan.head_dense_above,
                          plan.head_padded_rows)
        if config.tie_word_embeddings and isinstance(self.embed_tokens, BlockEmbedding) \
                and isinstance(self.lm_head, BlockLinear) and self.lm_head.segments[0] is not embed:
            # A tied head repacked for its kernel: the embedding looks its rows up there, one copy.
            self.embed_tokens = BlockEmbedding(self.lm_head.segments[0], dtype, gguf)
        self.norm = w("model.norm.weight")
        self.layers: list[_Layer] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv = [raw(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
            qkv_bias = (torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                        if config.attention_bias else None)
            self.layers.append(_Layer(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=linear(qkv, qkv_bias),
                o=linear([raw(p + "self_attn.o_proj.weight")]),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=linear([raw(p + "mlp.gate_proj.weight"), raw(p + "mlp.up_proj.weight")]),
                down=linear([raw(p + "mlp.down_proj.weight")]),
            ))
        inv_freq = _rope_inv_freq(config)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(pos, inv_freq)
        self.cos = freqs.cos().to(device=device, dtype=dtype)
        self.sin = freqs.sin().to(device=device, dtype=dtype)
        # The fused kernel rotates in fp32 whatever the storage dtype.
        self.rope = Rope(freqs.cos().to(device=device, dtype=torch.float32).contiguous(),
                         freqs.sin().to(device=device, dtype=torch.float32).contiguous(),
                         config.num_heads, config.num_kv_heads)
        self.scale = config.head_dim ** -0.5

    def weight_bytes(self) -> int:
        """Bytes the weights hold in memory, as run (packed formats and any dense copies); a tied
        LM head's blocks, shared with the embedding, once."""
        embed = self.embed_tokens.weight.blocks if isinstance(self.embed_tokens, BlockEmbedding) else self.embed_tokens
        plain = [embed, self.norm] + [t for ly in self.layers for t in (ly.input_norm, ly.post_norm)]
        linears = [self.lm_head] + [lw for ly in self.layers for lw in (ly.qkv, ly.o, ly.gate_up, ly.down)]
        unique = {t.data_ptr(): t for t in plain + [t for lw in linears for t in lw.tensors()]}
        return sum(t.numel() * t.element_size() for t in unique.values())

    def streamed_bytes(self) -> int:
        """Weight bytes a decode step reads: every linear layer's and the LM head's, in the form
        the decode kernels read them (blocks, packed or dense), not the embedding's rows."""
        linears = [self.lm_head] + [lw for ly in self.layers for lw in (ly.qkv, ly.o, ly.gate_up, ly.down)]
        unique = {t.data_ptr(): t for lw in linears for t in lw.decode_tensors()}
        return sum(t.numel() * t.element_size() for t in unique.values())

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # HF "rotate_half" form: the loaders un-permute GGUF Q/K so every format matches it.
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVTensors) -> torch.Tensor:
        """input_ids, positions: [T] for all scheduled tokens; returns hidden states [T, H]."""
        if self.kernels is not None:
            return self._forward_fused(input_ids, positions, meta, kv_cache)
        cfg = self.config
        nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = nh * hd, kvh * hd
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        h = self.embed_tokens[input_ids]
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.input_norm)
            q, k, v = layer.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
            q = self._rope(q.view(-1, nh, hd), cos, sin)
            k = self._rope(k.view(-1, kvh, hd), cos, sin)
            v = v.view(-1, kvh, hd)
            kv_cache.write(i, k, v, meta.slot_mapping)
            attn = paged_attention(q, k, v, kv_cache, i, meta, self.scale)
            h = h + layer.o(attn)
            x = self._rms_norm(h, layer.post_norm)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(torch.nn.functional.silu(gate) * up)
        return self._rms_norm(h, self.norm)

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       kv_cache: KVTensors) -> torch.Tensor:
        """The same math with each layer's elementwise steps as 4 fused calls (CPU), each native or
        torch's as measured."""
        cfg, ops = self.config, self.ops
        assert ops is not None  # forward() takes this path only with the native kernels
        nh, kvh, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        q_size, kv_size = nh * hd, kvh * hd
        h = self.embed_tokens[input_ids]  # a fresh tensor: the residual stream, updated in place
        x = ops.add_rms_norm(h, None, self.layers[0].input_norm, eps)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x)
            ops.rope_and_cache(qkv, positions, self.rope, kv_cache.k[i], kv_cache.v[i], meta.slot_mapping)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            attn = paged_attention(q.view(-1, nh, hd), k.view(-1, kvh, hd), v.view(-1, kvh, hd),
                                   kv_cache, i, meta, self.scale)
            x = ops.add_rms_norm(h, layer.o(attn), layer.post_norm, eps)
            mlp = layer.down(ops.silu_mul(layer.gate_up(x)))
            x = ops.add_rms_norm(h, mlp, self.norm if i == last else self.layers[i + 1].input_norm, eps)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
