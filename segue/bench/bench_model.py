"""`segue bench make-model`: a second benchmark model with production layer shapes.

The default model (SmolLM2-135M: 64-wide heads, hidden 576) hides what larger models pay: the
models agents run mostly have 128-wide heads and GEMMs ten times wider. This writes random
weights in Qwen2.5-1.5B's layer shapes (hidden 1,536; 12 query and 2 KV heads of 128 with Q/K/V
biases; MLP 8,960; RMSNorm eps 1e-6; RoPE theta 1e6; tied embeddings), 8 layers, with SmolLM2's
tokenizer and vocabulary, as a Hugging Face safetensors checkpoint that Segue and vLLM both load,
or with `--gguf TYPE` as one llama.cpp GGUF file quantized in llama.cpp's mix for that type.
Seeded: the same arguments write the same weights. Its outputs are noise; it measures speed.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from segue.bench import Benchmark

if TYPE_CHECKING:
    import torch

# Qwen2.5-1.5B's config.json, but for the layer count and vocabulary.
SHAPES = {"hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
          "tie_word_embeddings": True}
HEAD_DIM = 128
# llama.cpp's --ftype names -> the bulk weight type (see gguf_tensor_type for the exceptions).
GGUF_TYPES = ("q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0")
# HF name parts -> llama.cpp's (segue.model.gguf_loader.hf_tensor_name is the inverse).
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True,
                   help="directory to write the checkpoint to; with --gguf, the .gguf file to write (a path not "
                        "ending in .gguf is a directory, and the file in it is named qwen15b-shape-TYPE.gguf)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--seed", type=int, default=0, help="weights are drawn from a generator seeded with it")
    p.add_argument("--weight-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="stored weight dtype (safetensors only; --gguf quantizes the float32 draws)")
    p.add_argument("--gguf", choices=GGUF_TYPES, default=None, metavar="TYPE",
                   help=f"write one GGUF file in llama.cpp's mix for this type ({', '.join(GGUF_TYPES)}) "
                        "instead of a safetensors checkpoint")
    # For tests: smaller widths (multiples of 256 for the K-quants); heads stay 128 wide.
    p.add_argument("--hidden", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--intermediate", type=int, default=None, help=argparse.SUPPRESS)


def model_shapes(hidden: int | None = None, intermediate: int | None = None) -> dict[str, Any]:
    """SHAPES, or a narrower model: query heads = hidden / 128, KV heads = a sixth of them (at least 1).

    The vocabulary is always the tokenizer's, so it is not a parameter.
    """
    if hidden is None and intermediate is None:
        return dict(SHAPES)
    h = hidden or int(SHAPES["hidden_size"])
    if h % HEAD_DIM:
        raise ValueError(f"hidden size {h} is not a multiple of the head width {HEAD_DIM}")
    heads = h // HEAD_DIM
    return {**SHAPES, "hidden_size": h, "intermediate_size": intermediate or int(SHAPES["intermediate_size"]),
            "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 6)}


def draw_weights(vocab: int, layers: int, seed: int, dtype: torch.dtype,
                 shapes: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors in the generator's draw order, one at a time (a GGUF writer quantizes as it goes)."""
    import torch

    h, inter = int(shapes["hidden_size"]), int(shapes["intermediate_size"])
    kv = int(shapes["num_key_value_heads"]) * (h // int(shapes["num_attention_heads"]))
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm() -> torch.Tensor:
        return (1.0 + 0.05 * torch.randn(h, generator=gen)).to(dtype)

    yield "model.embed_tokens.weight", normal(vocab, h)
    yield "model.norm.weight", norm()
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm()
        yield p + "post_attention_layernorm.weight", norm()
        for proj, rows in (("q", h), ("k", kv), ("v", kv)):
            yield p + f"self_attn.{proj}_proj.weight", normal(rows, h)
            yield p + f"self_attn.{proj}_proj.bias", normal(rows)
        yield p + "self_attn.o_proj.weight", normal(h, h)
        yield p + "mlp.gate_proj.weight", normal(inter, h)
        yield p + "mlp.up_proj.weight", normal(inter, h)
        yield p + "mlp.down_proj.weight", normal(h, inter)


def write_checkpoint(out: pathlib.Path, layers: int, seed: int, dtype_name: str,
                     hidden: int | None = None, intermediate: int | None = None) -> pathlib.Path:
    import torch
    from safetensors.torch import save_file

    from segue.model.gguf_loader import load_gguf_tokenizer
    from segue.model.loader import default_model_path

    shapes = model_shapes(hidden, intermediate)
    tokenizer = load_gguf_tokenizer(default_model_path())
    vocab = len(tokenizer)
    tensors = dict(draw_weights(vocab, layers, seed, getattr(torch, dtype_name), shapes))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
              "num_hidden_layers": layers, "vocab_size": vocab, "torch_dtype": dtype_name,
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
              "attention_dropout": 0.0, "use_sliding_window": False, **shapes}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save_pretrained(out)
    return out


def gguf_name(hf_name: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    if stem in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)  # model.layers.N.<part>
    return f"blk.{layer}.{_GGUF_LAYER[part]}.{kind}"


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get Q6_K in Q4_K_M/Q5_K_M (C division)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def gguf_tensor_type(name: str, ndim: int, layers: int, mix: str) -> Any:
    """The GGMLQuantizationType llama.cpp's llama_tensor_get_type picks for `name` (GGUF name) in `mix`.

    Covers this model only (dense, tied, all widths multiples of 256): 1-D tensors stay F32; the tied
    token embedding, which is also the output matrix, takes the output's rule (Q6_K, or Q8_0 for q8_0);
    Q4_K_M/Q5_K_M raise attn_v and ffn_down to Q6_K in the use_more_bits layers.
    """
    from gguf import GGMLQuantizationType as T

    base = {"q4_k_m": T.Q4_K, "q5_k_m": T.Q5_K, "q6_k": T.Q6_K, "q8_0": T.Q8_0, "q4_0": T.Q4_0}[mix]
    if ndim == 1:
        return T.F32
    if name == "token_embd.weight":
        return T.Q8_0 if base == T.Q8_0 else T.Q6_K
    parts = name.split(".")
    if mix in ("q4_k_m", "q5_k_m") and parts[2] in ("attn_v", "ffn_down") and use_more_bits(int(parts[1]), layers):
        return T.Q6_K
    return base


def gguf_path(out: pathlib.Path, mix: str) -> pathlib.Path:
    return out if out.suffix == ".gguf" else out / f"qwen15b-shape-{mix.replace('_', '')}.gguf"


def write_gguf(out: pathlib.Path, layers: int, seed: int, mix: str,
               hidden: int | None = None, intermediate: int | None = None) -> tuple[pathlib.Path, Counter[str]]:
    """The seeded model (float32 draws, as write_checkpoint's float32 checkpoint) as one GGUF file.

    Returns the file and how many tensors each GGML type got.
    """
    import gguf
    import torch

    from segue.model.gguf_encode import encode
    from segue.model.loader import default_model_path

    shapes = model_shapes(hidden, intermediate)
    path = gguf_path(out, mix)
    path.parent.mkdir(parents=True, exist_ok=True)
    source = gguf.GGUFReader(str(default_model_path()))
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)  # token_embd must have one row per token

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name(f"Qwen2.5-1.5B-shaped random ({layers} layers, seed {seed})")
    writer.add_file_type(int(gguf.LlamaFileType[f"MOSTLY_{mix.upper()}"]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(int(shapes["max_position_embeddings"]))
    writer.add_embedding_length(int(shapes["hidden_size"]))
    writer.add_feed_forward_length(int(shapes["intermediate_size"]))
    writer.add_block_count(layers)
    writer.add_head_count(int(shapes["num_attention_heads"]))
    writer.add_head_count_kv(int(shapes["num_key_value_heads"]))
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(float(shapes["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(shapes["rms_norm_eps"]))
    # The tokenizer (vocab, merges, special ids, pre-tokenizer) and chat template, copied key by key.
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if array else None)

    counts: Counter[str] = Counter()
    for hf_name, tensor in draw_weights(vocab, layers, seed, torch.float32, shapes):
        name = gguf_name(hf_name)
        qtype = gguf_tensor_type(name, tensor.ndim, layers, mix)
        # Qwen2's Q/K rows are stored as HF has them: llama.cpp's qwen2 rope is NeoX-style (no permutation).
        writer.add_tensor(name, encode(tensor.numpy(), qtype), raw_dtype=qtype)
        counts[qtype.name] += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, counts


def run(args: argparse.Namespace) -> int:
    if args.gguf is None:
        out = write_checkpoint(pathlib.Path(args.out), args.layers, args.seed, args.weight_dtype,
                               args.hidden, args.intermediate)
        print(f"wrote a Qwen2.5-1.5B-shaped checkpoint ({args.layers} layers, {args.weight_dtype}, "
              f"seed {args.seed}) to {out}")
        return 0
    start = time.perf_counter()
    path, counts = write_gguf(pathlib.Path(args.out), args.layers, args.seed, args.gguf,
                              args.hidden, args.intermediate)
    mix = ", ".join(f"{name} {n}" for name, n in sorted(counts.items()))
    print(f"wrote a Qwen2.5-1.5B-shaped GGUF ({args.layers} layers, {args.gguf}, seed {args.seed}) to {path}: "
          f"{path.stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - start:.1f} s; tensors by type: {mix}")
    return 0


BENCHMARK = Benchmark("make-model", "write a random checkpoint in Qwen2.5-1.5B's layer shapes (a benchmark model)",
                      add_arguments, run)
