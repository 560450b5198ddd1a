"""The elementwise ops' torch forms compute what the native ones do (fp32 to the last bits that
summation order allows, bf16 to its rounding), FusedOps runs the form chosen per row count, and an
engine running the torch forms still equals transformers token for token."""
from __future__ import annotations

import functools

import pytest
import torch
import transformers

from conftest import make_tiny_checkpoint
from engine_helpers import hf_greedy, make_engine, run_to_completion
from segue.engine.engine_request import EngineRequest
from segue.model import fused_ops
from segue.model.cpu_kernels import load_cpu_kernels
from segue.model.fused_ops import FusedOps
from segue.sampling_params import SamplingParams

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels unavailable")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
@pytest.mark.parametrize("rows", [1, 9, 130])
def test_add_rms_norm(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 96, generator=g).to(dtype)
    delta = torch.randn(rows, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    h_native, h_torch = h.clone(), h.clone()
    out_native = KERNELS.add_rms_norm(h_native, delta, w, 1e-6)
    out_torch = fused_ops.add_rms_norm(h_torch, delta, w, 1e-6)
    assert torch.equal(h_native, h_torch)   # the residual update is one rounding in both
    torch.testing.assert_close(out_torch, out_native, **TOL[dtype])
    torch.testing.assert_close(fused_ops.add_rms_norm(h.clone(), None, w, 1e-6),
                               KERNELS.add_rms_norm(h.clone(), None, w, 1e-6), **TOL[dtype])


@DTYPES
@pytest.mark.parametrize("nh,kvh,hd", [(9, 3, 64), (12, 2, 128)])
def test_rope_and_cache(dtype, nh, kvh, hd):
    g = torch.Generator().manual_seed(hd)
    rows, blocks, bs = 21, 8, 16
    qkv = torch.randn(rows, (nh + 2 * kvh) * hd, generator=g).to(dtype)
    freqs = torch.outer(torch.arange(300, dtype=torch.float64), torch.rand(hd // 2, generator=g, dtype=torch.float64))
    cos, sin = freqs.cos().float().contiguous(), freqs.sin().float().contiguous()
    positions = torch.randint(0, 300, (rows,), generator=g)
    slots = torch.randperm(blocks * bs, generator=g)[:rows]
    results = []
    for native in (True, False):
        q, kc = qkv.clone(), torch.zeros(kvh, blocks, bs, hd, dtype=dtype)
        vc = torch.zeros_like(kc)
        if native:
            KERNELS.rope_and_cache(q, positions, cos, sin, kc, vc, slots, nh, kvh)
        else:
            fused_ops.rope_and_cache(q, positions, fused_ops.Rope(cos, sin, nh, kvh), kc, vc, slots)
        results.append((q, kc, vc))
    for native, torch_form in zip(*results, strict=True):
        torch.testing.assert_close(torch_form, native, **TOL[dtype])


@DTYPES
def test_silu_mul(dtype):
    gate_up = torch.randn(17, 2 * 80, generator=torch.Generator().manual_seed(0)).to(dtype)
    torch.testing.assert_close(fused_ops.silu_mul(gate_up), KERNELS.silu_mul(gate_up), **TOL[dtype])


def test_each_op_runs_the_form_chosen_for_its_row_count(monkeypatch):
    calls = []
    monkeypatch.setattr(fused_ops, "silu_mul", lambda x: calls.append(("torch", x.shape[0])) or x)
    ops = FusedOps(KERNELS, {"silu_mul": {1: "native", 8: "torch", 64: "native"}})
    for rows in (1, 5, 8, 9, 64, 500):
        ops.silu_mul(torch.zeros(rows, 4))
    # 5 and 8 rows follow the count timed at 8; past the ladder, the largest count's form.
    assert calls == [("torch", 5), ("torch", 8)]


def test_engine_with_torch_forms_equals_transformers(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "ckpt")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    engine = make_engine(path, quantization="none", budget=32, block_size=4)
    engine.executor.model.ops = FusedOps(KERNELS, {op: {1: "torch"} for op in fused_ops.OPS})
    prompts = [[100 + 7 * i + j for j in range(n)] for i, n in enumerate((5, 40, 70))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = [engine.add_request(EngineRequest(p, params)).request_id for p in prompts]
    results = run_to_completion(engine)
    greedy = functools.partial(hf_greedy, model, max_new_tokens=8)
    for rid, prompt in zip(ids, prompts, strict=True):
        assert results[rid].outputs[0].token_ids == greedy(prompt)
