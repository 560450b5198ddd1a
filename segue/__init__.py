"""Segue: an LLM serving engine for agentic and tool-using workloads."""
import os

# Before torch loads libgomp (it reads its environment once): OpenMP workers spin ~10k pauses
# (tens to hundreds of microseconds) between parallel regions instead of libgomp's default 300k.
# That still covers the gaps between a forward's back-to-back regions, but a served decode step
# also needs the event loop and the client to run on the same cores, and long spinning starved
# them: single-stream serving fell to 6 tok/s with the default, 90 with this (BENCHMARKS.md,
# AVX512-BF16 EPYC, 2 cores). An operator's own setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from segue.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # Heavy (torch) entry points load on first use so pure modules stay importable without torch.
    if name == "LLM":
        from segue.engine.llm import LLM
        return LLM
    if name == "AsyncLLMEngine":
        from segue.engine.async_engine import AsyncLLMEngine
        return AsyncLLMEngine
    if name == "LLMEngine":
        from segue.engine.llm_engine import LLMEngine
        return LLMEngine
    if name in ("EngineRequest", "RequestHints"):
        # What AsyncLLMEngine.generate and LLMEngine.add_request take.
        from segue.engine import engine_request
        return getattr(engine_request, name)
    raise AttributeError(name)


__all__ = ["LLM", "AsyncLLMEngine", "LLMEngine", "EngineRequest", "RequestHints", "SamplingParams", "__version__"]
