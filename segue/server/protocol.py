"""Wire models for the OpenAI-compatible endpoints, and their translation to SamplingParams.

Requests ignore unknown fields because OpenAI clients and agent frameworks send extras we do not
know, but known fields are strict: "abc" or "5" for an integer is a 400, not a silent coercion.
Fields that would change the result and that Segue cannot honour yet (n > 1, penalties, echo,
tools, ...) are rejected rather than ignored, so a client never gets quietly different output.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from segue.outputs import TokenLogprob
from segue.sampling_params import InvalidRequestError, SamplingParams

# Completion budget when the request names none: the rest of the context, capped so a client
# that forgets max_tokens on a long-context model does not tie up a sequence for minutes.
DEFAULT_MAX_TOKENS_CAP = 1024


def default_max_tokens(prompt_len: int, max_model_len: int) -> int:
    return max(1, min(max_model_len - prompt_len, DEFAULT_MAX_TOKENS_CAP))


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = None


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions. None means "not given" because
    many clients send explicit nulls for unset options."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Extensions (vLLM spelling), sent by the openai client through extra_body.
    top_k: int | None = None
    ignore_eos: bool | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise InvalidRequestError("n > 1 is not supported yet; send n separate requests")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise InvalidRequestError(f"{name} is not supported yet (only 0 is accepted)")

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "seed": self.seed}
        return SamplingParams(max_tokens=max_tokens, stop=self.stop or [], ignore_eos=bool(self.ignore_eos),
                              logprobs=logprobs, **{k: v for k, v in optional.items() if v is not None})


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) \
                and len(self.prompt) != 1:
            raise InvalidRequestError("batched prompts are not supported yet; send one prompt per request")
        if self.echo:
            raise InvalidRequestError("echo is not supported yet")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("best_of > 1 is not supported yet")

    def single_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt  # type: ignore[return-value]

    def to_sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens(prompt_len, max_model_len)
        return self._sampling_params(max_tokens, self.logprobs)


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: plain-string content, no OpenAI-only roles."""
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(f"content parts of type {part.type!r} are not supported; "
                                              "only text parts are")
            content = "".join(part.text or "" for part in self.content)
        else:
            content = self.content or ""
        # "developer" is OpenAI's newer name for the system role; templates only know "system".
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise InvalidRequestError("tools are not supported yet")
        if self.tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice is not supported yet (tools are not supported)")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError("response_format other than text is not supported yet")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true")

    def to_sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        # max_completion_tokens is OpenAI's replacement for the deprecated max_tokens.
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens(prompt_len, max_model_len)
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


# ---- responses --------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Also the streaming chunk: OpenAI uses the same "text_completion" shape for both."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI deltas carry only what changed: {"content": "x"}, and {} on the final chunk.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "segue"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=e.token, logprob=e.logprob, bytes=_utf8(e.token),
                         top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=_utf8(t)) for _, t, lp in e.top])
        for e in entries])


def completion_logprobs(entries: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    """`text_offset` is where the first entry's token starts in the completion text (non-zero for
    later streaming chunks)."""
    out = CompletionLogprobs()
    for e in entries:
        out.tokens.append(e.token)
        out.token_logprobs.append(e.logprob)
        # Distinct token ids can render to the same text; keep the more likely one.
        top: dict[str, float] = {}
        for _, text, lp in e.top:
            top.setdefault(text, lp)
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(e.token)
    return out
