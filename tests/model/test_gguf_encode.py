"""GGUF block encoders (segue/model/gguf_encode.py), checked against the gguf package's dequantizers,
and `segue bench make-model --gguf` writing a model Segue's GGUF loader reads back."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from segue.model.gguf_encode import encode

T = GGMLQuantizationType
TYPES = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
# fp16 scales: one ulp of relative error, and one smallest subnormal of absolute error (tiny blocks).
F16_REL, F16_ABS = 2.0**-10, 2.0**-24


def _error_bound(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Largest |dequantized - x| each weight may have, from its block's range; same shape as x."""
    block = GGML_QUANT_SIZES[qtype][0]
    b = x.reshape(-1, block).astype(np.float64)
    if qtype in (T.Q4_K, T.Q5_K):
        # w = d*sc*q - dmin*m, q < levels: half a step of the sub-block's range, plus the 6-bit rounding
        # of the sub-block scale and min against the block's d and dmin (each at most range / 63).
        levels = 15 if qtype == T.Q4_K else 31
        sub = b.reshape(-1, 8, 32)
        rng = sub.max(-1) - np.minimum(sub.min(-1), 0)
        whole = np.maximum(rng, -np.minimum(sub.min(-1), 0)).max(-1, keepdims=True)
        bound = 0.5 * rng / levels + whole / (63 * levels) * (1 + 4 * F16_REL) + F16_ABS
        return np.repeat(bound, 32, axis=-1).reshape(x.shape) + 1e-6 * np.abs(x).max()
    if qtype == T.Q6_K:
        # Symmetric, the largest weight at code -32: a weight of the other sign may clip at 31 (one step).
        amax = np.abs(b.reshape(-1, 16, 16)).max(-1)
        bound = amax / 32 + amax.max(-1, keepdims=True) / (32 * 127) * (1 + 4 * F16_REL) + F16_ABS
        return np.repeat(bound, 16, axis=-1).reshape(x.shape) + 1e-6 * np.abs(x).max()
    amax = np.abs(b).max(-1, keepdims=True)
    rng = b.max(-1, keepdims=True) - b.min(-1, keepdims=True)
    bound = {
        T.Q8_0: 0.5 * amax / 127 + amax * F16_REL,
        T.Q4_0: amax / 8 * (1 + 16 * F16_REL),  # the largest weight's sign sits at -8; the other end clips at 7
        T.Q5_0: amax / 16 * (1 + 32 * F16_REL),
        T.Q4_1: 0.5 * rng / 15 + (rng + amax) * F16_REL,
        T.Q5_1: 0.5 * rng / 31 + (rng + amax) * F16_REL,
    }[qtype]
    return np.broadcast_to(bound + 64 * F16_ABS, b.shape).reshape(x.shape)


def _roundtrip(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    raw = encode(x, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    assert raw.dtype == np.uint8 and raw.shape == (*x.shape[:-1], x.shape[-1] // block * size)
    return dequantize(raw, qtype).reshape(x.shape)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_matrix_round_trips_within_the_format_error(qtype):
    rng = np.random.default_rng(int(qtype))
    # Rows of different scales (weights ~0.02 as in a model, and ~1), and an offset row.
    x = rng.standard_normal((24, 512)).astype(np.float32)
    x[:8] *= 0.02
    x[16:] += 0.5
    y = _roundtrip(x, qtype)
    assert np.all(np.abs(y - x) <= _error_bound(x, qtype))
    # A sanity check on quality beyond the worst case: the RMS error relative to the weights.
    expected_rms = {T.Q4_K: 0.1, T.Q5_K: 0.05, T.Q6_K: 0.025, T.Q8_0: 0.006,
                    T.Q4_0: 0.1, T.Q4_1: 0.1, T.Q5_0: 0.05, T.Q5_1: 0.05}[qtype]
    scale = np.sqrt((x[:8] ** 2).mean())
    assert np.sqrt(((y[:8] - x[:8]) ** 2).mean()) < expected_rms * scale
    # Encoding what came back lands close again: within a fraction of the first pass's error.
    z = _roundtrip(y, qtype)
    assert np.all(np.abs(z - y) <= _error_bound(y, qtype))
    assert np.sqrt(((z - y) ** 2).mean()) <= 0.75 * np.sqrt(((y - x) ** 2).mean())
    if qtype in (T.Q8_0, T.Q4_0, T.Q5_0):
        assert np.array_equal(z, y)  # symmetric formats re-derive exactly the same scale


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_edge_case_rows(qtype):
    rng = np.random.default_rng(7)
    k = 512
    rows = [
        np.zeros(k),
        np.full(k, 0.37),
        np.full(k, -1.25),
        -np.abs(rng.standard_normal(k)),  # negative only
        np.abs(rng.standard_normal(k)) + 3.0,  # positive only, far from zero
        rng.standard_normal(k) * 1e-3,  # tiny: the fp16 block scales are subnormal
        np.where(np.arange(k) % 97 == 0, 50.0, rng.standard_normal(k) * 0.01),  # outliers
        np.concatenate([np.zeros(k // 2), rng.standard_normal(k // 2)]),  # zero blocks beside live ones
    ]
    x = np.stack(rows).astype(np.float32)
    y = _roundtrip(x, qtype)
    assert np.all(np.isfinite(y))
    assert np.all(np.abs(y - x) <= _error_bound(x, qtype))
    assert np.array_equal(y[0], x[0])  # zeros stay exactly zero
    assert np.array_equal(y[7, : k // 2], x[7, : k // 2])
    z = _roundtrip(y, qtype)
    assert np.all(np.abs(z - y) <= _error_bound(y, qtype))


def test_layouts_against_hand_built_blocks():
    """One weight set per sub-block, so a misplaced nibble or scale shows up as a wrong value."""
    # Each sub-block holds a ramp from its own min to its own max, the two not in proportion, so every
    # sub-block's scale and min differ from each other and from the other sub-blocks'.
    x = np.concatenate([np.linspace(-0.2 * (j + 1), 3 - 0.3 * j, 32) for j in range(8)]).astype(np.float32)[None, :]
    for qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        y = _roundtrip(x, qtype)
        assert np.all(np.abs(y - x) <= _error_bound(x, qtype)), qtype.name


def test_encode_keeps_leading_dims_and_float_types():
    x = np.random.default_rng(1).standard_normal((2, 3, 256)).astype(np.float32)
    assert encode(x, T.Q4_K).shape == (2, 3, 144)
    assert np.array_equal(dequantize(encode(x, T.F32), T.F32).reshape(x.shape), x)
    assert np.array_equal(dequantize(encode(x, T.F16), T.F16).reshape(x.shape), x.astype(np.float16))
    with pytest.raises(ValueError):
        encode(np.zeros((2, 100), np.float32), T.Q4_K)
    with pytest.raises(NotImplementedError):
        encode(np.zeros((2, 256), np.float32), T.IQ2_XXS)


def test_q4_k_m_mix_follows_llama_cpp():
    from segue.bench.bench_model import gguf_tensor_type, use_more_bits

    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(28) if use_more_bits(i, 28)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert gguf_tensor_type("token_embd.weight", 2, 8, "q4_k_m") == T.Q6_K
    assert gguf_tensor_type("token_embd.weight", 2, 8, "q8_0") == T.Q8_0
    assert gguf_tensor_type("token_embd.weight", 2, 8, "q4_0") == T.Q6_K
    assert gguf_tensor_type("blk.3.attn_v.weight", 2, 8, "q4_k_m") == T.Q6_K
    assert gguf_tensor_type("blk.4.ffn_down.weight", 2, 8, "q4_k_m") == T.Q4_K
    assert gguf_tensor_type("blk.0.ffn_down.weight", 2, 8, "q5_k_m") == T.Q6_K
    assert gguf_tensor_type("blk.1.attn_q.weight", 2, 8, "q5_k_m") == T.Q5_K
    assert gguf_tensor_type("blk.0.attn_q.bias", 1, 8, "q4_k_m") == T.F32


@pytest.mark.slow
def test_make_model_writes_a_gguf_the_loader_reads(tmp_path):
    """A tiny-width model (hidden 256, MLP 512, 2 layers, the real 49,152-token vocabulary) in Q4_K_M."""
    import torch

    from segue.bench.bench_model import write_gguf
    from segue.model.gguf_loader import hf_tensor_name, load_gguf

    path, counts = write_gguf(tmp_path, layers=2, seed=5, mix="q4_k_m", hidden=256, intermediate=512)
    assert path == tmp_path / "qwen15b-shape-q4km.gguf"
    # Layer 1 of 2 is a use_more_bits layer: its attn_v and ffn_down, and token_embd, are Q6_K.
    assert counts == {"F32": 11, "Q4_K": 12, "Q6_K": 3}
    reader = GGUFReader(str(path))
    assert {t.name: t.tensor_type for t in reader.tensors}["blk.1.ffn_down.weight"] == T.Q6_K
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "qwen2"
    assert all(hf_tensor_name(t.name) is not None for t in reader.tensors)

    ckpt = load_gguf(path)
    cfg = ckpt.config
    assert (cfg.architecture, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == ("qwen2", 256, 512, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (2, 1, 128, 49152)
    assert cfg.attention_bias and cfg.tie_word_embeddings
    assert cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 1e6 and cfg.max_position_embeddings == 32768
    assert ckpt.chat_template and len(ckpt.tokenizer) == 49152
    by_name = {t.name: t for t in reader.tensors}
    for gguf_name, hf_name in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                               ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
                               ("token_embd.weight", "model.embed_tokens.weight"),
                               ("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias")):
        t = by_name[gguf_name]
        expected = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        assert torch.equal(ckpt.weights[hf_name], torch.from_numpy(np.array(expected, dtype=np.float32)))
    # The same seed draws the same weights as the float32 safetensors checkpoint, then quantizes them.
    from segue.bench.bench_model import draw_weights, model_shapes

    first = dict(draw_weights(49152, 2, 5, torch.float32, model_shapes(256, 512)))
    q = ckpt.weights["model.layers.0.self_attn.q_proj.weight"]
    assert torch.allclose(q, first["model.layers.0.self_attn.q_proj.weight"], atol=0.01)
    assert torch.equal(ckpt.weights["model.norm.weight"], first["model.norm.weight"])
