"""What every checkpoint format loads into, and the checks they share: a `LoadedCheckpoint` with
weights under Hugging Face Llama names, checked against the shapes the config implies, and the EOS
ids generation stops on. loader.py (safetensors) and gguf_loader.py both build on this module."""
from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import transformers

from segue.model.config import ModelConfig
from segue.model.gguf_blocks import GGMLBlocks

# A checkpoint's tensors: dense, or a GGUF file's quantized matrices as their blocks.
Weight = torch.Tensor | GGMLBlocks

# Chat templates close a turn with one of these; when the template emits one, generation must stop on it
# even if the checkpoint's declared EOS is a different token (e.g. <|endoftext|> vs <|im_end|>).
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


class CheckpointError(ValueError):
    """A checkpoint path is missing, unreadable, inconsistent or describes an unsupported model."""


@dataclasses.dataclass
class LoadedCheckpoint:
    config: ModelConfig
    weights: dict[str, Weight]
    tokenizer: transformers.PreTrainedTokenizerBase
    chat_template: str | None
    name: str
    path: str
    # The bytes a GGUF file's tensors take in it (what resident weights are compared with).
    file_tensor_bytes: int | None = None


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward pass reads, with the shape the config implies."""
    h, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_dim)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    return shapes


def finalize_weights(
    config: ModelConfig, raw: Mapping[str, Weight], dtype: torch.dtype, source: pathlib.Path
) -> dict[str, Weight]:
    """Check names and shapes against the config and cast, so a bad file fails here, not mid-forward."""
    shapes = expected_shapes(config)
    missing = [name for name in shapes if name not in raw]
    if missing:
        raise CheckpointError(f"{source}: {len(missing)} expected tensors are missing, e.g. {missing[:3]}")
    # A tied lm_head copy and cached rotary tables are harmless; anything else (an o_proj bias, MoE experts)
    # means a model variant the forward pass would silently compute wrongly.
    extra = [
        name
        for name in raw
        if name not in shapes and name != "lm_head.weight" and not name.endswith("rotary_emb.inv_freq")
    ]
    if extra:
        raise CheckpointError(f"{source}: unsupported model variant, unexpected tensors such as {extra[:3]}")
    weights: dict[str, Weight] = {}
    for name, shape in shapes.items():
        tensor = raw[name]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, but the config implies {shape}"
            )
        # Blocks stay as the file stores them: the native kernels read them (gguf_blocks.py).
        weights[name] = tensor if isinstance(tensor, GGMLBlocks) else tensor.to(device="cpu", dtype=dtype).contiguous()
    return weights


def as_id_tuple(value: Any) -> tuple[int, ...]:
    """Token-id fields come as None, an int or a list depending on the file."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def resolve_eos_ids(
    declared: Iterable[int], tokenizer: transformers.PreTrainedTokenizerBase, chat_template: str | None
) -> tuple[int, ...]:
    ids = list(dict.fromkeys(declared))
    if not ids and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if chat_template:
        vocab = tokenizer.get_vocab()
        for token in _END_OF_TURN_TOKENS:
            if token in chat_template and token in vocab and vocab[token] not in ids:
                ids.append(int(vocab[token]))
    return tuple(ids)
