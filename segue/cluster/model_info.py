"""What a replica tells the pool about the model it serves (front.py answers the server from it).
Its own module so replicas and the front can both use it without importing each other."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from segue.engine import LLMEngine


@dataclass
class ModelInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    chat_template: str | None
    tokenizer: Any
    # The model's recommended sampling settings (segue/generation_defaults.py).
    generation_defaults: dict[str, Any] = field(default_factory=dict)


def model_info(llm: "LLMEngine") -> ModelInfo:
    return ModelInfo(llm.model_name, llm.max_model_len, llm.model_config.vocab_size, llm.chat_template,
                     llm.tokenizer, dict(llm.generation_defaults))
