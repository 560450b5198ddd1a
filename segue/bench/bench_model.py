"""`segue bench make-model`: a second benchmark model with production layer shapes.

The default model (SmolLM2-135M: 64-wide heads, hidden 576) hides what larger models pay: the
models agents run mostly have 128-wide heads and GEMMs ten times wider. This writes random
weights in Qwen2.5-1.5B's layer shapes (hidden 1,536; 12 query and 2 KV heads of 128 with Q/K/V
biases; MLP 8,960; RMSNorm eps 1e-6; RoPE theta 1e6; tied embeddings), 8 layers, with SmolLM2's
tokenizer and vocabulary, as a Hugging Face safetensors checkpoint that Segue and vLLM both load.
Seeded: the same arguments write the same weights. Its outputs are noise; it measures speed.
"""
from __future__ import annotations

import argparse
import json
import pathlib

from segue.bench import Benchmark

# Qwen2.5-1.5B's config.json, but for the layer count and vocabulary.
SHAPES = {"hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
          "tie_word_embeddings": True}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory to write the checkpoint to")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--seed", type=int, default=0, help="weights are drawn from a generator seeded with it")
    p.add_argument("--weight-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="stored weight dtype")


def write_checkpoint(out: pathlib.Path, layers: int, seed: int, dtype_name: str) -> pathlib.Path:
    import torch
    from safetensors.torch import save_file

    from segue.model.gguf_loader import load_gguf_tokenizer
    from segue.model.loader import default_model_path

    dtype = getattr(torch, dtype_name)
    tokenizer = load_gguf_tokenizer(default_model_path())
    vocab = len(tokenizer)
    h, inter = int(SHAPES["hidden_size"]), int(SHAPES["intermediate_size"])
    hd = h // int(SHAPES["num_attention_heads"])
    kv = int(SHAPES["num_key_value_heads"]) * hd
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm() -> torch.Tensor:
        return (1.0 + 0.05 * torch.randn(h, generator=gen)).to(dtype)

    tensors = {"model.embed_tokens.weight": normal(vocab, h), "model.norm.weight": norm()}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": normal(h, h), p + "self_attn.q_proj.bias": normal(h),
            p + "self_attn.k_proj.weight": normal(kv, h), p + "self_attn.k_proj.bias": normal(kv),
            p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.v_proj.bias": normal(kv),
            p + "self_attn.o_proj.weight": normal(h, h),
            p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
        })
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
              "num_hidden_layers": layers, "vocab_size": vocab, "torch_dtype": dtype_name,
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
              "attention_dropout": 0.0, "use_sliding_window": False, **SHAPES}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save_pretrained(out)
    return out


def run(args: argparse.Namespace) -> int:
    out = write_checkpoint(pathlib.Path(args.out), args.layers, args.seed, args.weight_dtype)
    print(f"wrote a Qwen2.5-1.5B-shaped checkpoint ({args.layers} layers, {args.weight_dtype}, "
          f"seed {args.seed}) to {out}")
    return 0


BENCHMARK = Benchmark("make-model", "write a random checkpoint in Qwen2.5-1.5B's layer shapes (a benchmark model)",
                      add_arguments, run)
