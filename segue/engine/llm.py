"""Offline batch API: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

from typing import cast

from tqdm import tqdm

from segue.config import CacheConfig, EngineConfig, ModelLoadConfig, SchedulerConfig
from segue.engine.engine_request import EngineRequest
from segue.engine.llm_engine import LLMEngine
from segue.outputs import RequestOutput
from segue.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "auto",
                 config: EngineConfig | None = None, **overrides) -> None:
        if config is None:
            config = EngineConfig(model=ModelLoadConfig(model=model, dtype=dtype, device=device))
            for key, value in overrides.items():
                for section in (config.cache, config.scheduler, config.model, config):
                    if hasattr(section, key):
                        setattr(section, key, value)
                        break
                else:
                    raise TypeError(f"unknown engine option {key!r}")
        self.engine = LLMEngine(config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        one = isinstance(prompts, str) or bool(prompts) and isinstance(prompts[0], int)
        batch = cast(list[str | list[int]], [prompts] if one else prompts)
        params = params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(batch)
        requests = [EngineRequest(p, sp) for p, sp in zip(batch, params_list, strict=True)]
        ids = [self.engine.add_request(r).request_id for r in requests]
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generate") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = cast(list[list[dict]], [messages] if one else messages)
        prompts = [self.engine.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params, use_tqdm)


__all__ = ["LLM", "SamplingParams", "CacheConfig", "SchedulerConfig"]
