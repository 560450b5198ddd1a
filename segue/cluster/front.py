"""The model side of a pool: what the server asks of `engine.engine` that is about the model.

The server reads the model's name, context window, tokenizer and chat template from the engine
(ServingContext). Replicas all serve the same checkpoint, so the pool answers those questions once,
in the server's process, from a description replica 0 sends (ModelInfo: the tokenizer travels
pickled). Per-engine state (queues, KV, tool statistics) stays on the replicas; the only thing the
server writes, tool duration hints, fans out to all of them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from segue.cluster.model_info import ModelInfo
from segue.sampling_params import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from segue.cluster.replica import EngineReplica


class ToolHintFanout:
    """Stands in for LLMEngine.tool_stats where the server sets hints: every replica gets them."""

    def __init__(self, replicas: Sequence["EngineReplica"]) -> None:
        self._replicas = list(replicas)

    def set_hint(self, name: str, seconds: float | None) -> None:
        for replica in self._replicas:
            replica.set_tool_hint(name, seconds)


class ModelFront:
    def __init__(self, info: ModelInfo, replicas: Sequence["EngineReplica"]) -> None:
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.chat_template = info.chat_template
        self.tokenizer = info.tokenizer
        self.generation_defaults = info.generation_defaults
        self.tool_stats = ToolHintFanout(replicas)

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise InvalidRequestError(f"model {self.model_name} has no chat template; use completions")
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt)

    def make_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                     arrival_time: float | None = None, priority: int = 0, program_id: str | None = None,
                     tool_parser: Any = None, cache_salt: str | None = None,
                     expected_tool_s: float | None = None) -> list[int]:
        """The prompt's token ids, checked as LLMEngine.make_request checks them. It runs before
        routing, so a bad request never reaches the router's prefix index; the replica checks the
        hints and builds the actual request. The signature is LLMEngine's: the server reads it to
        learn which hints (cache_salt) the engines take."""
        params.validate()
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens but this model's context window is "
                f"{self.max_model_len} tokens (prompt plus at least one generated token)")
        return token_ids
