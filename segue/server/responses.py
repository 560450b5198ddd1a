"""Response wire models (OpenAI shapes) and logprob conversions."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

from segue.outputs import TokenLogprob


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

    @classmethod
    def of_choices(cls, usages: list["Usage"], shared_prompt: int) -> "Usage":
        """One usage for n choices of one prompt: the prompt (`shared_prompt` tokens, cached as
        the first choice found it) counts once; what each choice read beyond it (tool results)
        and everything the choices generated add up."""
        first = usages[0]
        prompt = first.prompt_tokens + sum(u.prompt_tokens - shared_prompt for u in usages[1:])
        cached = first.prompt_tokens_details.cached_tokens if first.prompt_tokens_details else 0
        return cls.of(prompt, sum(u.completion_tokens for u in usages), cached)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class _WithSchemaViolation(BaseModel):
    # Segue extension, per choice: where and why a best-effort structured answer (a schema without
    # `strict`) breaks its schema (server/structured_formats.py); omitted when it matches. On the
    # final chunk of a streamed choice, beside its finish_reason.
    schema_violation: str | None = None

    @model_serializer(mode="wrap")
    def _omit_no_violation(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        violation = data.pop("schema_violation", None)
        if violation is not None:
            data["schema_violation"] = violation  # after the choice's own fields
        return data


class CompletionChoice(_WithSchemaViolation):
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


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):
    """Streaming form: a whole call in one delta (calls are known only once complete)."""
    index: int


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _omit_empty_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class _WithSession(BaseModel):
    # Segue extension: the session that holds the conversation (omitted when there is none).
    session_id: str | None = None

    @model_serializer(mode="wrap")
    def _omit_no_session(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("session_id") is None:
            data.pop("session_id", None)
        return data


class ChatChoice(_WithSchemaViolation):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_WithSession):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI deltas carry only what changed: {"content": "x"}, and {} on the final chunk.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_WithSchemaViolation):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_WithSession):
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
