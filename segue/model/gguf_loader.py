"""GGUF (llama.cpp) checkpoints: metadata -> ModelConfig, tensors -> HF-named weights.

With `keep_blocks`, matrices in a block format the native kernels read (segue/model/gguf_blocks.py)
stay as the file's blocks; every other tensor (and every tensor without `keep_blocks`) is dequantized
once at load time to `dtype`. The tokenizer and chat template come from the file's own metadata via transformers'
GGUF tokenizer converter, so a lone .gguf file is a complete checkpoint.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any

import numpy as np
import torch
import transformers

from segue.model.checkpoint import CheckpointError, LoadedCheckpoint, finalize_weights, resolve_eos_ids
from segue.model.config import ModelConfig
from segue.model.gguf_blocks import NATIVE_TYPES, GGMLBlocks

# general.architecture -> ModelConfig.architecture. llama.cpp also stores Mistral models as "llama".
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
# Only llama.cpp's LlamaModel converter permutes Q/K rows (its rope is GPT-J style there); Qwen2 uses
# NeoX-style rope in llama.cpp, which matches HF's rotate_half layout, so its rows are stored unchanged.
_PERMUTED_QK_ARCHITECTURES = {"llama"}

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp pre-tokenizer types that isolate every digit before the GPT-2 regex split.
_DIGIT_SPLIT_PRE_TYPES = {"smollm", "starcoder"}
# Trailing quantization tag in file names like "SmolLM2-135M-Instruct.Q4_1" or "model-q4_k_m".
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def load_gguf(path: pathlib.Path, dtype: torch.dtype = torch.float32, keep_blocks: bool = False) -> LoadedCheckpoint:
    reader = _open_reader(path)
    meta = _Metadata(reader, path)
    gguf_arch = meta.get("general.architecture")
    family = _ARCHITECTURES.get(gguf_arch) if isinstance(gguf_arch, str) else None
    if family is None:
        supported = sorted(_ARCHITECTURES)
        raise CheckpointError(f"{path}: unsupported GGUF architecture {gguf_arch!r}; supported: {supported}")

    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style scaling survives in GGUF only as a per-frequency table whose parameters cannot be
        # recovered exactly; refusing beats silently computing a different rotary embedding.
        raise CheckpointError(f"{path}: per-frequency rope scaling (rope_freqs tensor) is not supported")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise CheckpointError(f"{path}: no token_embd.weight tensor")

    config = _model_config(meta, gguf_arch, family, tensor_names, vocab_size=int(embed.shape[1]))
    if keep_blocks and any(int(t.tensor_type) in NATIVE_TYPES for t in reader.tensors):
        from segue.model.cpu_kernels import load_gguf_kernels

        keep_blocks = load_gguf_kernels() is not None  # else dequantized here, as before
    raw = _read_tensors(reader, config, permute_qk=gguf_arch in _PERMUTED_QK_ARCHITECTURES, path=path,
                        keep_blocks=keep_blocks)
    weights = finalize_weights(config, raw, dtype, path)

    tokenizer = load_gguf_tokenizer(path, pre_type=meta.get("tokenizer.ggml.pre"))
    chat_template = meta.get("tokenizer.chat_template") or tokenizer.chat_template
    chat_template = chat_template if isinstance(chat_template, str) else None

    declared = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    eos = resolve_eos_ids([int(i) for i in declared if i is not None], tokenizer, chat_template)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    config = dataclasses.replace(config, bos_token_id=None if bos is None else int(bos), eos_token_ids=eos)
    name = _QUANT_SUFFIX.sub("", path.stem) or path.stem
    return LoadedCheckpoint(config, weights, tokenizer, chat_template, name, str(path),
                            file_tensor_bytes=sum(int(t.n_bytes) for t in reader.tensors))


def load_gguf_tokenizer(
    path: str | pathlib.Path, pre_type: str | None = None
) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer described by a .gguf file's metadata; reads no tensor data.

    `pre_type` (tokenizer.ggml.pre) is read from the file when not given.
    """
    from tokenizers import pre_tokenizers

    path = pathlib.Path(path)
    if pre_type is None:
        pre_type = _Metadata(_open_reader(path), path).get("tokenizer.ggml.pre")
    try:
        # The generic fast class, not AutoTokenizer: it converts the same metadata but skips building a
        # model config from the file (a second full metadata parse, ~3 s) and keeps the converted
        # tokenizer as is instead of swapping in a model-specific class.
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except Exception as e:  # the converter raises assorted types for unknown tokenizer models
        raise CheckpointError(f"{path}: cannot build a tokenizer from the GGUF metadata: {e}") from e
    if pre_type in _DIGIT_SPLIT_PRE_TYPES:
        # transformers' converter does not know these pre-tokenizer types and falls back to the plain GPT-2
        # split, which keeps a space glued to a following number (" 12" vs " ", "1", "2") and so encodes
        # runs of spaces before digits differently from llama.cpp and the original tokenizer.json.
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return tokenizer


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF Llama name for a llama.cpp tensor name, or None when it has no counterpart."""
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    return None


def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation so rows match HF's rotate_half rotary layout.

    Within each head, HF pairs dimension i with i + head_dim/2; llama.cpp's converter reorders the rows
    to interleave those pairs (i, i + head_dim/2 adjacent) for its GPT-J-style rope. Works for weight
    matrices and 1-D biases alike.
    """
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class _Metadata:
    """Typed access to GGUF key/value fields, decoding only the keys asked for (the vocab is huge)."""

    def __init__(self, reader: Any, path: pathlib.Path) -> None:
        self._fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        from gguf import GGUFValueType

        field = self._fields.get(key)
        if field is None:
            return default
        try:
            if field.types[0] == GGUFValueType.ARRAY:
                return [self._scalar(field.parts[i], field.types[-1]) for i in field.data]
            return self._scalar(field.parts[field.data[0]], field.types[0])
        except (IndexError, UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{self.path}: malformed metadata field {key!r}: {e}") from e

    @staticmethod
    def _scalar(part: np.ndarray, vtype: Any) -> Any:
        from gguf import GGUFValueType

        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        if part.dtype == np.float32:
            # Shortest decimal that round-trips in float32, so 1e-5 reads back as 1e-05, not 9.9999997e-06.
            return float(str(part[0]))
        return part.tolist()[0]

    def require_int(self, key: str) -> int:
        value = self.get(key)
        if not isinstance(value, int):  # per-layer arrays (variable head counts) land here too
            raise CheckpointError(f"{self.path}: metadata {key!r} is {value!r}, expected one integer")
        return value


def _open_reader(path: pathlib.Path) -> Any:
    from gguf import GGUFReader

    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFReader(str(path), "r")
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on truncated or corrupt files
        raise CheckpointError(f"{path}: corrupt or truncated GGUF file: {e}") from e
    if not reader.tensors:
        raise CheckpointError(f"{path}: GGUF file holds no tensors")
    return reader


def _model_config(
    meta: _Metadata, arch: str, family: str, tensor_names: set[str], vocab_size: int
) -> ModelConfig:
    hidden = meta.require_int(f"{arch}.embedding_length")
    heads = meta.require_int(f"{arch}.attention.head_count")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    rotary_dims = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if not isinstance(kv_heads, int) or rotary_dims != head_dim:
        raise CheckpointError(
            f"{meta.path}: unsupported attention layout (kv heads {kv_heads!r}, rotary dims {rotary_dims!r}, "
            f"head dim {head_dim!r})"
        )
    rope_scaling = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
    elif scaling_type != "none":
        raise CheckpointError(f"{meta.path}: rope scaling type {scaling_type!r} is not supported")
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=meta.require_int(f"{arch}.feed_forward_length"),
        num_layers=meta.require_int(f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        max_position_embeddings=meta.require_int(f"{arch}.context_length"),
        # llama.cpp's own fallbacks when a converter omitted the key.
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        rope_scaling=rope_scaling,
        architecture=family,
    )


def _read_tensors(
    reader: Any, config: ModelConfig, permute_qk: bool, path: pathlib.Path, keep_blocks: bool = False
) -> dict[str, torch.Tensor | GGMLBlocks]:
    from gguf.quants import dequantize

    raw: dict[str, torch.Tensor | GGMLBlocks] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            raise CheckpointError(f"{path}: unexpected tensor {t.name!r} (unsupported model variant?)")
        # GGUF lists dims fastest-varying first (ne0 = row length), the reverse of torch/numpy order;
        # the reader already exposes data in numpy order, and dequantize keeps the row structure.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if keep_blocks and int(t.tensor_type) in NATIVE_TYPES and len(shape) == 2:
            raw[name] = _blocks(t, shape, name, config, permute_qk, path)
            continue
        try:
            arr = dequantize(t.data, t.tensor_type)
            arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
        except NotImplementedError as e:
            raise CheckpointError(f"{path}: tensor {t.name} uses unsupported type {t.tensor_type.name}") from e
        except (ValueError, IndexError) as e:
            raise CheckpointError(f"{path}: tensor {t.name} is truncated or corrupt: {e}") from e
        if not arr.flags.writeable:  # F32 data is a view into the read-only memory map
            arr = arr.copy()
        tensor = torch.from_numpy(arr)
        if permute_qk and ".self_attn.q_proj." in name:
            tensor = unpermute_rotary_rows(tensor, config.num_heads)
        elif permute_qk and ".self_attn.k_proj." in name:
            tensor = unpermute_rotary_rows(tensor, config.num_kv_heads)
        raw[name] = tensor
    return raw


def _blocks(t: Any, shape: tuple[int, ...], name: str, config: ModelConfig, permute_qk: bool,
            path: pathlib.Path) -> GGMLBlocks:
    rows, k = int(shape[0]), int(shape[1])
    data = np.asarray(t.data)
    if data.dtype != np.uint8 or data.size % rows:
        raise CheckpointError(f"{path}: tensor {t.name} is truncated or corrupt ({data.size} bytes for {rows} rows)")
    # A copy: the reader's arrays view a read-only memory map of the file.
    weight = GGMLBlocks(torch.from_numpy(data.reshape(rows, -1).copy()), int(t.tensor_type), (rows, k))
    heads = config.num_heads if ".self_attn.q_proj." in name else \
        config.num_kv_heads if ".self_attn.k_proj." in name else 0
    if permute_qk and heads:
        weight = weight.rows(unpermute_rotary_rows(torch.arange(rows), heads))
    return weight

