"""Prompts in: chat templating, tokenization and the checks every prompt passes before it may
become a request. One implementation, used by the engine and by a cluster's front (which checks a
prompt before routing it, so a bad one never reaches the router's prefix index)."""
from __future__ import annotations

from segue.engine.model_info import ModelInfo
from segue.sampling_params import InvalidRequestError, SamplingParams


class InputProcessor:
    """Stateless over a ModelInfo, so safe from any thread (tokenizers are)."""

    def __init__(self, info: ModelInfo) -> None:
        self.info = info

    def encode(self, text: str) -> list[int]:
        # Chat templates write the special tokens themselves; a second BOS would shift the prompt.
        return self.info.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids` with special tokens kept (an end-of-turn token's own text)."""
        return self.info.tokenizer.decode(token_ids, skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not self.info.chat_template:
            raise InvalidRequestError(f"model {self.info.model_name} has no chat template; use completions")
        return self.info.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=self.info.chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt)

    def process(self, prompt: str | list[int], params: SamplingParams) -> tuple[str | None, list[int]]:
        """(the prompt's text, or None for token ids; its token ids), once params and prompt are
        valid for this model. Raises InvalidRequestError (a 400) otherwise."""
        params.validate()
        if isinstance(prompt, str):
            text, token_ids = prompt, self.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.info.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.info.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens but this model's context window is "
                f"{self.info.max_model_len} tokens (prompt plus at least one generated token)")
        return text, token_ids
