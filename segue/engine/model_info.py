"""What an engine tells its callers about the model it serves: the same on every replica, fixed
for the engine's life. Plain data, so it pickles to a cluster's front (the tokenizer travels too)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelInfo:
    model_name: str
    # The context window: prompt plus generated tokens.
    max_model_len: int
    vocab_size: int
    chat_template: str | None
    tokenizer: Any
    # The model's recommended sampling settings (segue/engine/generation_defaults.py).
    generation_defaults: dict[str, Any] = field(default_factory=dict)
