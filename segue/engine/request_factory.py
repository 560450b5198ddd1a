"""Making a request for the engine from a prompt, off the engine thread.

RequestFactory takes an EngineRequest (engine/engine_request.py), validates and tokenizes its
prompt (engine/input_processor.py), builds a constrained request's grammar matcher (the
constrained-decoding backend, created on first use), the request's incremental detokenizer and
its tool-call parser (from the format the request names), and hands back the RequestState the
engine adds between steps. It reads only the model, never engine state, so callers run it on
their own worker threads: a long tokenization or a cold grammar compile never stalls the step loop.
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from segue.engine.detokenizer import IncrementalDetokenizer
from segue.engine.engine_request import EngineRequest
from segue.engine.input_processor import InputProcessor
from segue.engine.request_text import RequestState
from segue.outputs import RequestMetrics
from segue.request import Request
from segue.sampling_params import SamplingParams
from segue.tools.parser import ToolCallParser


class RequestFactory:
    """Safe from any thread."""

    def __init__(self, inputs: InputProcessor, tokenizer: Any, model_config: Any, max_model_len: int) -> None:
        self.inputs = inputs
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_model_len = max_model_len
        self._grammars: Any = None
        # make_request runs on worker threads: two first constrained requests must share one backend.
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> Any:
        """The constrained-decoding backend (segue.structured.backend), created on first use so
        engines that never see a constrained request never import the grammar library."""
        with self._grammars_lock:
            if self._grammars is None:
                from segue.structured.backend import GrammarBackend
                # Every end-of-turn token the generation config names may end a constrained answer.
                eos = self.model_config.eos_token_ids or (self.tokenizer.eos_token_id,)
                self._grammars = GrammarBackend(self.tokenizer, self.model_config.vocab_size, eos)
            return self._grammars

    def compile_grammar(self, params: SamplingParams | None) -> Any:
        """The compiled constraint of `params` (None if it has none)."""
        if params is None or params.structured is None:
            return None
        return self.grammars.compile(params.structured)

    def make_request(self, request: EngineRequest) -> RequestState:
        """Validate and tokenize without touching engine state; the engine's own tool-call parser
        comes from the request's format."""
        params = request.params
        text, token_ids = self.inputs.process(request.prompt, params)
        request_id = request.request_id or uuid.uuid4().hex
        now = time.monotonic() if request.arrival_time is None else request.arrival_time
        hints = request.hints
        req = Request(request_id, token_ids, params, now, self.model_config.eos_token_ids,
                      priority=hints.priority, program_id=hints.program_id, cache_salt=hints.cache_salt,
                      latency_sensitive=hints.latency_sensitive)
        if params.structured is not None:
            req.grammar = self.grammars.matcher(params.structured, start=0,
                                                output_limit=self.max_model_len - len(token_ids))
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, params)
        parser = ToolCallParser.for_format(request.tool_format) if request.tool_format is not None else None
        return RequestState(req, text, detok, RequestMetrics(arrival_time=now),
                            [] if params.logprobs is not None else None, tool_parser=parser,
                            expected_tool_s=hints.expected_tool_s)
