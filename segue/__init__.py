"""Segue: an LLM serving engine for agentic and tool-using workloads."""
from segue.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # Heavy (torch) entry points load on first use so pure modules stay importable without torch.
    if name == "LLM":
        from segue.llm import LLM
        return LLM
    if name == "AsyncLLMEngine":
        from segue.async_engine import AsyncLLMEngine
        return AsyncLLMEngine
    if name == "LLMEngine":
        from segue.engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "AsyncLLMEngine", "LLMEngine", "SamplingParams", "__version__"]
