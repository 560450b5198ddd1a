"""Request wire models for the OpenAI-compatible endpoints, and their translation to SamplingParams.

Requests ignore unknown fields because OpenAI clients and agent frameworks send extras we do not
know, but known fields are strict: "abc" or "5" for an integer is a 400, not a silent coercion.
Fields that would change the result and that Segue cannot honour yet (penalties, echo, ...) are
rejected rather than ignored, so a client never gets quietly different output. Response models
live in responses.py.

`n` choices are n engine requests for the same prompt (see README, "n choices"): up to MAX_N, and
not with sessions or client-side tools, whose paused request a session holds (one per session).
"""
from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from segue.engine.engine_request import RequestHints
from segue.program.registry import scoped_program_id
from segue.sampling_params import InvalidRequestError, SamplingParams
from segue.server.errors import APIError
from segue.server.structured_formats import output_spec
from segue.structured import StructuredSpec

# Completion budget when the request names none: the rest of the context, capped so a client
# that forgets max_tokens on a long-context model does not tie up a sequence for minutes.
DEFAULT_MAX_TOKENS_CAP = 1024
# Choices per request: each is a whole engine request, so n is bounded like a batch would be.
MAX_N = 16
_SEED_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: consecutive indexes land far apart
_MASK63 = (1 << 63) - 1


def default_max_tokens(prompt_len: int, max_model_len: int) -> int:
    return max(1, min(max_model_len - prompt_len, DEFAULT_MAX_TOKENS_CAP))


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index`: choice 0 keeps the request's seed (so n=1 and the first of n
    agree); the others get distinct seeds derived from it, so choices differ yet reproduce."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _SEED_MIX) & _MASK63


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
    # Checked in check_supported (an OpenAI-style message); the bounds are declared for the schema.
    n: int | None = Field(default=None, json_schema_extra={"minimum": 1, "maximum": MAX_N})
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
    # Constrained output (structured_formats.py): OpenAI's response_format, and vLLM's guided
    # decoding extras.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    # Segue extensions (extra_body): scheduling hints passed to the engine.
    priority: int | None = None
    program_id: str | None = Field(default=None, max_length=256)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def check_supported(self) -> None:
        if not 1 <= self.num_choices <= MAX_N:
            raise APIError(400, f"n must be an integer in [1, {MAX_N}], got {self.n}", param="n",
                           code="invalid_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise InvalidRequestError(f"{name} is not supported yet (only 0 is accepted)", param=name,
                                          code="unsupported_value")

    def engine_hints(self, tenant: str | None, cache_salt: str | None) -> RequestHints:
        program_id = scoped_program_id(tenant, self.program_id) if self.program_id is not None else None
        return RequestHints(priority=self.priority or 0, program_id=program_id, cache_salt=cache_salt)

    def output_spec(self) -> StructuredSpec | None:
        return output_spec(self.response_format, self.guided_json, self.guided_regex, self.guided_choice)

    @property
    def output_param(self) -> str:
        """The field whose schema a JSON answer must match (output_spec: never both), for errors."""
        return "response_format" if self.response_format is not None else "guided_json"

    def _sampling_params(self, max_tokens: int, logprobs: int | None,
                         defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the model's recommended sampling settings (engine/generation_defaults.py), used for
        the ones the client leaves out, as vLLM does with generation_config.json."""
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}
        return SamplingParams.from_request(max_tokens, self.stop, self.ignore_eos, given, defaults,
                                           logprobs=logprobs, structured=self.output_spec())


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
            raise InvalidRequestError("batched prompts are not supported yet; send one prompt per request",
                                      param="prompt", code="unsupported_value")
        if self.echo:
            raise InvalidRequestError("echo is not supported yet", param="echo", code="unsupported_value")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix", code="unsupported_value")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("best_of > 1 is not supported yet", param="best_of", code="unsupported_value")

    def single_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt  # type: ignore[return-value]

    def to_sampling_params(self, prompt_len: int, max_model_len: int,
                           defaults: dict[str, Any] | None = None) -> SamplingParams:
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens(prompt_len, max_model_len)
        return self._sampling_params(max_tokens, self.logprobs, defaults)


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCallIn(_Request):
    name: str
    arguments: str = ""


class ToolCallIn(_Request):
    """A tool call in an assistant message of the history (as the client got it from us)."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string; only text parts exist for a text-only model."""
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(f"content parts of type {part.type!r} are not supported; "
                                              "only text parts are", param="messages", code="unsupported_value")
            return "".join(part.text or "" for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Checked in chat_tools.py (JSON-schema validation needs more than a type annotation).
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Segue extensions (extra_body).
    session_id: str | None = Field(default=None, max_length=128)
    # Keep the conversation in a session even when this turn ends normally (a human turn).
    open_session: bool | None = None
    # The client's estimate of how long its tools take: the interception policy's duration hint.
    expected_tool_seconds: float | None = Field(default=None, ge=0, le=86400)

    def check_supported(self) -> None:
        super().check_supported()
        if self.num_choices > 1 and (self.session_id is not None or self.open_session):
            raise APIError(400, "n > 1 cannot be combined with sessions (session_id, open_session): a session "
                                "continues one conversation", param="n")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs",
                                      code="invalid_value")
        # Chat's top_logprobs is the engine's logprobs count: checked here so the error names it.
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise InvalidRequestError(f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs}",
                                      param="top_logprobs", code="invalid_value")

    def to_sampling_params(self, prompt_len: int, max_model_len: int,
                           defaults: dict[str, Any] | None = None) -> SamplingParams:
        # max_completion_tokens is OpenAI's replacement for the deprecated max_tokens.
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens(prompt_len, max_model_len)
        try:
            return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults)
        except InvalidRequestError as e:
            if e.param == "max_tokens" and self.max_completion_tokens is not None:
                raise InvalidRequestError(str(e).replace("max_tokens", "max_completion_tokens", 1),
                                          param="max_completion_tokens", code=e.code) from None
            raise
