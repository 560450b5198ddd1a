"""Native CPU kernels, compiled once per machine with torch's extension builder.

Torch has no paged attention for CPUs, and gathering blocks into a dense tensor triples the
memory traffic of decode attention (measured: ~4 ms vs ~1 ms per layer at batch 64). The same
module fuses the decoder layer's elementwise steps (residual + RMSNorm, RoPE + KV write,
SiLU-gating), which in torch form are dozens of small ops per layer. When the build is impossible
(no compiler, no ninja) the engine logs why and uses the torch path.
"""
from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_attention.cpp", "fused_ops.cpp", "quant_ops.cpp")]


@lru_cache(maxsize=1)
def load_cpu_kernels():
    """The compiled module, or None when disabled (SEGUE_DISABLE_CPU_KERNELS=1) or unbuildable."""
    if os.environ.get("SEGUE_DISABLE_CPU_KERNELS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(name="segue_cpu_paged_attention", sources=[str(p) for p in _SOURCES],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # the torch path is correct, only slower
        logger.warning("CPU paged-attention kernel unavailable (%s); using the torch path", e)
        return None
