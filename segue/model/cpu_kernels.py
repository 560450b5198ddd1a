"""Native CPU kernels, compiled once per machine with torch's extension builder.

Torch has no paged attention for CPUs, and gathering blocks into a dense tensor triples the
memory traffic of decode attention (measured: ~4 ms vs ~1 ms per layer at batch 64). The same
module fuses the decoder layer's elementwise steps (residual + RMSNorm, RoPE + KV write,
SiLU-gating), which in torch form are dozens of small ops per layer. When the build is impossible
(no compiler, no ninja) the engine logs why and uses the torch path.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Iterator

from segue.model.kernel_table import cpu_identity

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("paged_attention.cpp", "prefill_attention.cpp", "fused_ops.cpp", "quant_ops.cpp")]
# Headers the sources include: part of the module's hash, not compiled on their own.
_HEADERS = [Path(__file__).parent / "csrc" / name
            for name in ("avx2_common.h", "prefill_bf16.h", "decode_attention_avx2.h")]
_GGUF_SOURCES = [Path(__file__).parent / "csrc" / "gguf_ops.cpp"]
_GGUF_HEADERS = [Path(__file__).parent / "csrc" / name
                 for name in ("gguf_fp32.h", "gguf_bf16.h", "gguf_dot.h", "gguf_dot_formats.h", "gguf_rows16.h",
                              "gguf_rows16_q8_0.h", "gguf_rows16_ops.h")]


_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


def _module_name(prefix: str = "segue_cpu_kernels", sources: list[Path] = _SOURCES,
                 headers: list[Path] = _HEADERS) -> str:
    """Named by a hash of the sources, the compiler flags and the CPU's identity: two checkouts
    with different kernels (or an upgrade) do not rebuild over each other's cache entry, and a
    module built with -march=native for one CPU is never loaded on another (where it could die
    of SIGILL), e.g. from a home directory shared between machines."""
    digest = hashlib.sha256()
    for path in sources + headers:
        digest.update(path.read_bytes())
    digest.update(" ".join(_CFLAGS).encode())
    digest.update(json.dumps(cpu_identity(), sort_keys=True).encode())
    return f"{prefix}_{digest.hexdigest()[:12]}"


@contextmanager
def _builder_lock(name: str) -> Iterator[None]:
    """Held while this process builds or loads `name`. torch's builder marks a build with a lock
    file and waits for ever on one that a killed build left behind; an flock goes with its process,
    so once it is held no live builder is behind such a file and it is removed. A second server
    starting during a build waits here, and says so, instead of hanging silently."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    fd = os.open(build_dir / "segue-build.flock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is building the CPU kernels (%s): waiting for it", name)
            fcntl.flock(fd, fcntl.LOCK_EX)
        torch_lock = build_dir / "lock"
        if torch_lock.exists():
            logger.warning("removing a CPU-kernel build lock left by a build that never finished: %s", torch_lock)
            torch_lock.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock


def _build(prefix: str, sources: list[Path], headers: list[Path]) -> ModuleType:
    from torch.utils.cpp_extension import load

    name = _module_name(prefix, sources, headers)
    with _builder_lock(name):
        return load(name=name, sources=[str(p) for p in sources], extra_cflags=_CFLAGS,
                    extra_ldflags=["-fopenmp"], verbose=False)


@lru_cache(maxsize=1)
def load_cpu_kernels() -> ModuleType | None:
    """The compiled module, or None when disabled (SEGUE_DISABLE_CPU_KERNELS=1) or unbuildable."""
    if os.environ.get("SEGUE_DISABLE_CPU_KERNELS") == "1":
        return None
    try:
        return _build("segue_cpu_kernels", _SOURCES, _HEADERS)
    except Exception as e:  # the torch path is correct, only slower
        logger.warning("CPU paged-attention kernel unavailable (%s); using the torch path", e)
        return None


@lru_cache(maxsize=1)
def load_gguf_kernels() -> ModuleType | None:
    """The matmuls over GGUF block formats (csrc/gguf_ops.cpp), a module of their own so that
    checkpoints without GGUF blocks never wait for their build; None when disabled or
    unbuildable (the weights are then dequantized once at load time)."""
    if os.environ.get("SEGUE_DISABLE_CPU_KERNELS") == "1":
        return None
    try:
        return _build("segue_gguf_kernels", _GGUF_SOURCES, _GGUF_HEADERS)
    except Exception as e:  # dequantized weights are correct, only larger and slower
        logger.warning("GGUF block kernels unavailable (%s); K-quant weights are dequantized at load", e)
        return None
