"""`segue bench make-model` writes a checkpoint in Qwen2.5-1.5B's layer shapes that Segue's own
loader and transformers both read, the same for the same seed."""
from __future__ import annotations

import pytest
import safetensors.torch
import torch

from segue.bench.bench_model import write_checkpoint
from segue.model.loader import load_checkpoint


@pytest.mark.slow
def test_a_seeded_checkpoint_with_production_shapes(tmp_path):
    a = write_checkpoint(tmp_path / "a", layers=1, seed=3, dtype_name="bfloat16")
    ckpt = load_checkpoint(a)
    cfg = ckpt.config
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == \
        (1536, 12, 2, 128, 8960)
    assert cfg.attention_bias and cfg.tie_word_embeddings and cfg.num_layers == 1
    assert cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 1e6
    assert cfg.vocab_size == len(ckpt.tokenizer)
    b = write_checkpoint(tmp_path / "b", layers=1, seed=3, dtype_name="bfloat16")
    wa = safetensors.torch.load_file(a / "model.safetensors")
    wb = safetensors.torch.load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
