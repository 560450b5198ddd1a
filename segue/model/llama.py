"""Llama-family decoder forward over a paged KV cache (Llama 2/3, SmolLM2, Qwen2, Mistral).

Weights are plain tensors, not nn.Modules: the forward is a short list of fused matmuls, and
keeping it flat keeps the per-layer Python overhead low, which matters for a 135M model on CPU.
"""
from __future__ import annotations

import math

import torch

from segue.model.attention import AttentionMetadata, paged_attention
from segue.model.config import ModelConfig
from segue.model.kv_cache import KVCache


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


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        self.embed_tokens = w("model.embed_tokens.weight")
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else w("lm_head.weight")
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            qkv_bias = (torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                        if config.attention_bias else None)
            self.layers.append(dict(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=qkv, qkv_bias=qkv_bias,
                o=w(p + "self_attn.o_proj.weight"),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                down=w(p + "mlp.down_proj.weight"),
            ))
        inv_freq = _rope_inv_freq(config)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(pos, inv_freq)
        self.cos = freqs.cos().to(device=device, dtype=dtype)
        self.sin = freqs.sin().to(device=device, dtype=dtype)
        self.scale = config.head_dim ** -0.5

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
                kv_cache: KVCache) -> torch.Tensor:
        """input_ids, positions: [T] for all scheduled tokens; returns hidden states [T, H]."""
        cfg = self.config
        nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = nh * hd, kvh * hd
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        h = self.embed_tokens[input_ids]
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer["input_norm"])
            qkv = torch.nn.functional.linear(x, layer["qkv"], layer["qkv_bias"])
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = self._rope(q.view(-1, nh, hd), cos, sin)
            k = self._rope(k.view(-1, kvh, hd), cos, sin)
            v = v.view(-1, kvh, hd)
            kv_cache.write(i, k, v, meta.slot_mapping)
            attn = paged_attention(q, k, v, kv_cache, i, meta, self.scale)
            h = h + torch.nn.functional.linear(attn, layer["o"])
            x = self._rms_norm(h, layer["post_norm"])
            gate, up = torch.nn.functional.linear(x, layer["gate_up"]).chunk(2, dim=-1)
            h = h + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, layer["down"])
        return self._rms_norm(h, self.norm)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.lm_head)
