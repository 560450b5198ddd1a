"""Compiling specs into llguidance matchers, cached by spec.

One backend per engine (per tokenizer). Building llguidance's tokenizer view costs ~2 s, so it is
built once, lazily, by the first constrained request. A compiled grammar is kept as a pristine
matcher; each request gets a deep copy (microseconds), which is what makes the cache pay: the
Earley tables and lexer built at compile time are shared, the parse state is the request's own.
Compilation runs on the caller's thread (the server validates in a worker thread), never on the
engine loop: a spec compiles together with what constrains the output after a resume (Compiled.next),
so a resume only copies a matcher it already holds, and a resume with new sampling params gets them
compiled before it is queued to the engine (engine/async_engine.py).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from segue.sampling_params import InvalidRequestError
from segue.structured.closing import ClosingSteer
from segue.structured.request_grammar import Compiled, RequestGrammar
from segue.structured.spec import StructuredKind, StructuredSpec
from segue.structured.tool_grammar import with_json_options

MAX_CACHED_GRAMMARS = 512


@dataclass
class CompileStats:
    compiles: int = 0
    hits: int = 0
    compile_seconds: list[float] = field(default_factory=list)


class GrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: int | Sequence[int]) -> None:
        eos_token_ids = (eos_token_ids,) if isinstance(eos_token_ids, int) else tuple(eos_token_ids)
        if not eos_token_ids:
            raise ValueError("a grammar backend needs at least one end-of-sequence token")
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        # llguidance knows one end-of-sequence token (the first); a finished answer may end with any
        # of them (Llama-3-Instruct ends a turn with <|eot_id|>, its eos[0] is <|end_of_text|>).
        self.eos_token_ids = eos_token_ids
        self.eos_token_id = self.eos_token_ids[0]
        self._ll_tokenizer: Any = None
        self._steer: ClosingSteer | None = None
        self._cache: OrderedDict[StructuredSpec, Compiled] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CompileStats()

    @property
    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id)
            return self._ll_tokenizer

    @property
    def closing_steer(self) -> ClosingSteer:
        tokenizer = self.ll_tokenizer
        with self._lock:
            if self._steer is None:
                self._steer = ClosingSteer(tokenizer, self.vocab_size, self.eos_token_ids)
            return self._steer

    def _grammar_text(self, spec: StructuredSpec) -> str:
        from llguidance import LLMatcher

        if spec.kind is StructuredKind.JSON_SCHEMA:
            import json
            return LLMatcher.grammar_from_json_schema(json.dumps(with_json_options(json.loads(spec.value))))
        if spec.kind is StructuredKind.REGEX:
            return LLMatcher.grammar_from_regex(spec.value)
        return LLMatcher.grammar_from_lark(spec.value)

    def compile(self, spec: StructuredSpec) -> Compiled:
        """The compiled `spec` (and what follows it after a resume); InvalidRequestError (a 400) for
        grammars or schemas llguidance cannot compile."""
        follow = spec.next_after_resume
        after = self.compile(follow) if follow is not None and follow is not spec else None
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.stats.hits += 1
                return hit
        from llguidance import LLMatcher

        t0 = time.perf_counter()
        tokenizer = self.ll_tokenizer
        self.closing_steer  # noqa: B018 -- built here (~0.3 s, once), never on the engine loop
        try:
            grammar = self._grammar_text(spec)
        except ValueError as e:
            raise InvalidRequestError(f"invalid {spec.kind.value} constraint: {e}") from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise InvalidRequestError(f"unsupported {spec.kind.value} constraint: {'; '.join(messages)}")
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"unsupported {spec.kind.value} constraint: {matcher.get_error()}")
        compiled = Compiled(spec, matcher, after)
        if follow is spec:
            compiled.next = compiled
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds.append(time.perf_counter() - t0)
            self._cache[spec] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredSpec | Compiled, start: int, output_limit: int | None = None) -> RequestGrammar:
        """A fresh per-request matcher that constrains output tokens from index `start` on;
        `output_limit`: output tokens the context window leaves the request (see RequestGrammar)."""
        compiled = spec if isinstance(spec, Compiled) else self.compile(spec)
        return RequestGrammar(compiled, start, self.eos_token_ids, self.closing_steer, output_limit)
