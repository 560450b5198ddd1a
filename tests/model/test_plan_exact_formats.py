"""The plan keeps a checkpoint's numbers: every fused projection is checked for exactness, and a
batch-invariant run of a file a format holds exactly runs in that format, not re-quantized."""
from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_checkpoint
from segue.config import ModelLoadConfig
from segue.executor.kernel_plan import lossless_formats, plan_kernels
from segue.model.cpu_kernels import load_cpu_kernels
from segue.model.loader import load_checkpoint
from segue.model.quant import Quantization, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

KERNELS = load_cpu_kernels()


def _rounded(weights: dict, fmt: str, skip: str | None = None) -> dict:
    """Every matrix (but `skip`) made exactly representable in `fmt` (as a GGUF file's are)."""
    out = {}
    for name, w in weights.items():
        if w.dim() == 2 and w.shape[1] % 32 == 0 and (skip is None or skip not in name):
            w = dequantize_int4(*quantize_int4(w)) if fmt == "int4" else dequantize_int8(*quantize_int8(w))
        out[name] = w
    return out


@pytest.fixture
def ckpt(tmp_path):
    return load_checkpoint(make_tiny_checkpoint(tmp_path / "m"), dtype=torch.float32)


@pytest.mark.parametrize("inexact", ["k_proj", "v_proj", "up_proj"])
def test_a_fused_projection_that_breaks_the_format_is_seen(ckpt, inexact):
    """Before, only q/o/gate/down were read: a k, v or up matrix off the format slipped through."""
    exact = _rounded(ckpt.weights, "int4")
    assert "int4" in lossless_formats(exact, ckpt.config)[0]
    assert lossless_formats(_rounded(ckpt.weights, "int4", skip=inexact), ckpt.config)[0] == set()


@pytest.mark.skipif(KERNELS is None, reason="native CPU kernels unavailable")
def test_batch_invariant_runs_an_exact_int4_file_in_int4(ckpt):
    load = ModelLoadConfig(batch_invariant=True)
    exact = _rounded(ckpt.weights, "int4")
    plan = plan_kernels(load, ckpt.config, torch.device("cpu"), KERNELS, exact)
    assert plan.batch_invariant and plan.quantization is Quantization.INT4
    # A float checkpoint: int8 as before (batch invariance runs a quantized kernel at every size).
    plan = plan_kernels(load, ckpt.config, torch.device("cpu"), KERNELS, ckpt.weights)
    assert plan.quantization is Quantization.INT8
