"""EngineClient: everything the HTTP server (and programs) may ask of "the engine".

One typed seam; a new request crosses it as one EngineRequest (engine/engine_request.py). Two
implementations: AsyncLLMEngine (one engine on its own thread) and cluster.EnginePool (several
replicas behind a router). Nothing above this seam reads engine or
scheduler internals: each question the server has about a request (the tokens a paused request
holds, a hint about when it resumes) or the engine (a metrics snapshot) is an EngineCall
(engine/calls.py) sent through `call`, answered on the engine's side.
tests/test_architecture.py checks that the server imports nothing else of the engine.

Methods that touch requests are safe from the event loop; the ones marked "blocking" tokenize or
render and belong in a worker thread (the server's ServingContext.in_thread).
"""
from __future__ import annotations

from typing import AsyncGenerator, Awaitable, Protocol, runtime_checkable

from segue.engine.calls import EngineCall, R
from segue.engine.engine_request import EngineRequest
from segue.engine.model_info import ModelInfo
from segue.outputs import RequestOutput
from segue.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine (every replica of a pool) stopped or died; the server answers 503."""


@runtime_checkable
class EngineClient(Protocol):
    # ---- the model (fixed for the engine's life) --------------------------------------------
    def model_info(self) -> ModelInfo: ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added (blocking)."""

    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids`, special tokens kept (blocking)."""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The prompt text of a chat (blocking); InvalidRequestError if the model has no template."""

    # ---- requests ---------------------------------------------------------------------------
    def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """The cumulative output after every new token; the last has finished=True, or paused=True
        for a request paused at a tool call (its calls on CompletionOutput.tool_calls, parsed by
        the engine in the request's tool_format) or at a turn end. Leaving the iterator early
        aborts the request unless it was detach()ed. The prompt is validated first
        (InvalidRequestError)."""

    def continue_request(self, request_id: str, tokens: list[int], params: SamplingParams | None = None,
                         keep: int | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Resume a paused, detached request with `tokens` appended (a session's next turn) and
        stream it anew; `params` replace its sampling settings. `keep`: its context is first cut
        after that many tokens (LLMEngine.resume)."""

    async def resume(self, request_id: str, tokens: list[int], params: SamplingParams | None = None,
                     keep: int | None = None) -> None:
        """Resume a paused request whose stream is still open (a server-side tool returned)."""

    def detach(self, request_id: str) -> None:
        """Keep a paused request when its stream closes; it leaves by continue_request or Abort."""

    # ---- calls about requests (abort, paused requests) and stats --------------------------
    def call(self, op: EngineCall[R]) -> Awaitable[R]:
        """`op` (engine/calls.py) for the engine; awaiting the result gives its answer. An Abort is
        sent before call() returns and answered at once: aborts never wait, so callers (a closing
        stream, a session dropping its held turn) may drop the result."""

    # ---- scheduling hints -------------------------------------------------------------------
    def set_latency_sensitive(self, request_id: str, latency_sensitive: bool) -> None: ...

    def set_tool_hint(self, name: str, seconds: float | None) -> None:
        """A tool's expected duration, used until its calls have been observed (None: no hint)."""

    def forget_program(self, program_id: str) -> None:
        """A program (session) ended: nothing need stay together for it any more."""

    # ---- observability and life cycle -------------------------------------------------------
    @property
    def is_running(self) -> bool: ...

    @property
    def num_unfinished_requests(self) -> int: ...

    async def shutdown(self, drain_timeout: float = 0.0) -> None: ...
