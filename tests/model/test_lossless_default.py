"""`--quantization auto` never changes a checkpoint's numbers, and a quantized layer keeps no dense
copy beside its packed weights unless some batch size runs the GEMM over it."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import make_engine
from segue.model.cpu_kernels import load_cpu_kernels
from segue.model.quant import EVERY_BATCH, LinearWeights, Quantization

KERNELS = load_cpu_kernels()


def test_auto_serves_a_float_checkpoint_unquantized(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint())   # float32, quantization "auto"
    plan = engine.executor.plan
    assert plan.quantization is Quantization.NONE and plan.quantized_rows == 0
    assert plan.head_quantization in (None, Quantization.NONE) and plan.head_quantized_rows == 0


@pytest.mark.skipif(KERNELS is None, reason="native CPU kernels unavailable")
@pytest.mark.parametrize("quant", [Quantization.INT8, Quantization.INT4])
def test_packed_weights_only_unless_a_gemm_needs_them(quant):
    w = torch.randn(256, 128)
    every = LinearWeights(w, None, quant, torch.float32, KERNELS, dense_above=EVERY_BATCH)
    split = LinearWeights(w, None, quant, torch.float32, KERNELS, dense_above=16)
    assert every.dense is None and split.dense is not None
    dense_bytes = w.numel() * 4
    assert every.nbytes < dense_bytes / 2          # int8: ~1/4 of fp32, int4: ~1/8
    assert split.nbytes == every.nbytes + dense_bytes
    x = torch.randn(3, 128)
    torch.testing.assert_close(every(x), split(x))  # both run the native kernel at 3 rows
