"""Constrained decoding (segue/structured): masks, grammars, the compile cache, the sampler hook.

Runs on the default model's tokenizer only (no weights); engine-level checks with the model are in
test_structured_engine.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import default_tokenizer
from segue.model.sampler import sample
from segue.sampling_params import InvalidRequestError, SamplingParams
from segue.structured import StructuredSpec
from segue.structured.backend import GrammarBackend
from segue.structured.bitmask import apply_bitmask, fill_bitmask
from segue.structured.tool_grammar import auto_grammar, closed_objects, forced_grammar, no_call_grammar
from segue.tools.parser import ToolCallParser

EOS = 2
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                                         "maximum": 7}},
    "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {"name": "web_search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    tok = default_tokenizer()
    return GrammarBackend(tok, len(tok), EOS)


def encode(text: str) -> list[int]:
    return default_tokenizer().encode(text, add_special_tokens=False)


def accepts(backend: GrammarBackend, spec: StructuredSpec, text: str, complete: bool = True) -> bool:
    m = backend.matcher(spec, 0).matcher
    return m.consume_tokens(encode(text)) and (m.is_accepting() or not complete)


def test_apply_bitmask_matches_the_bits() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 100
    logits = torch.randn(3, vocab, generator=gen)
    mask = torch.randint(-2**31, 2**31 - 1, (2, 4), dtype=torch.int32, generator=gen)
    out = apply_bitmask(logits, mask, [0, 2])
    for row, j in ((0, 0), (2, 1)):
        for t in range(vocab):
            allowed = (int(mask[j, t // 32]) >> (t % 32)) & 1
            assert out[row, t].item() == (logits[row, t].item() if allowed else float("-inf"))
    assert torch.equal(out[1], logits[1])


def test_sampler_samples_only_allowed_tokens_and_reports_raw_logprobs() -> None:
    logits = torch.zeros(2, 64)
    logits[:, 5] = 10.0  # the model's favourite
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[:, 0] = (1 << 7) | (1 << 9)  # only tokens 7 and 9
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=1.0, seed=3)]
    for _ in range(5):
        greedy, sampled = sample(logits, params, [0, 0], (mask, [0, 1]))
        assert greedy.token_id in (7, 9) and sampled.token_id in (7, 9)
        # The reported distribution is the model's, not the masked one.
        assert greedy.top[0][0] == 5


def test_forced_call_grammar_emits_what_the_parser_reads(backend: GrammarBackend) -> None:
    spec = forced_grammar([WEATHER, SEARCH])
    good = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
    assert accepts(backend, spec, good)
    _, calls = ToolCallParser().find_calls(good)
    assert calls[0].name == "get_weather" and calls[0].arguments == {"city": "Paris", "days": 3}
    for bad in ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 9}}</tool_call>',
                '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
                '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
                'Sure! <tool_call>', '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": 3, "extra": 1}}</tool_call>'):
        assert not accepts(backend, spec, bad, complete=False), bad
    named = forced_grammar([SEARCH], [WEATHER, SEARCH])
    assert not accepts(backend, named, good, complete=False)
    assert named.after_resume == auto_grammar([WEATHER, SEARCH])


def test_finished_grammar_allows_only_end_of_sequence(backend: GrammarBackend) -> None:
    g = backend.matcher(forced_grammar([SEARCH]), start=1)
    out = [999] + encode('<tool_call>{"name": "web_search", "arguments": {"query": "x"}}</tool_call>')
    mask, rows = fill_bitmask([None, g], [[], out], len(default_tokenizer()))
    assert rows == [1] and g.num_consumed == len(out) - 1
    allowed = [t for t in range(mask.shape[1] * 32) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed == [EOS]


def test_auto_grammar_allows_text_or_a_valid_call_only(backend: GrammarBackend) -> None:
    spec = auto_grammar([WEATHER])
    assert accepts(backend, spec, "It is sunny, no tool needed. <tool maybe")
    assert accepts(backend, spec, 'Let me check. <tool_call>{"name": "get_weather", "arguments": '
                                  '{"city": "Oslo", "days": 1}}</tool_call>')
    assert not accepts(backend, spec, "Let me check. <tool_call>get_weather(Oslo)", complete=False)
    text_only = no_call_grammar()
    assert accepts(backend, text_only, "The weather in Paris is sunny.")
    assert not accepts(backend, text_only, "<tool_call>{", complete=False)


def test_compiled_grammars_are_cached_and_copies_are_independent(backend: GrammarBackend) -> None:
    a = StructuredSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    assert a == b and a is not b
    hits = backend.stats.hits
    assert backend.compile(a) is backend.compile(b)
    assert backend.stats.hits >= hits + 1
    m1, m2 = backend.matcher(a, 0), backend.matcher(a, 0)
    assert m1.matcher.consume_tokens(encode('{"x": 1'))
    assert m2.matcher.consume_tokens(encode('{"x": 22}')) and m2.matcher.is_accepting()


@pytest.mark.parametrize("spec", [
    # Invalid JSON Schema, not merely a keyword the grammar does not enforce (test_structured_tools.py).
    StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "strnig"}}}),
    StructuredSpec.regex("(unclosed"),
    StructuredSpec.lark("start: undefined_rule\n"),
])
def test_unsupported_constraints_are_client_errors(backend: GrammarBackend, spec: StructuredSpec) -> None:
    with pytest.raises(InvalidRequestError, match="constraint"):
        backend.compile(spec)


def test_properties_are_generated_in_schema_order(backend: GrammarBackend) -> None:
    spec = StructuredSpec.json_schema({"type": "object", "properties": {"name": {"type": "string"},
                                                                        "age": {"type": "integer"}},
                                       "required": ["name", "age"]})
    assert accepts(backend, spec, '{"name": "Ann", "age": 3}')
    assert not accepts(backend, spec, '{"age": 3, "name": "Ann"}', complete=False)


def test_closed_objects_narrow_only_unspecified_objects() -> None:
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"a": {"type": "string"}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "list": {"type": "array", "items": {"type": "object", "properties": {"b": {}}}}}}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    # A property that happens to be named "properties" is a property, not a keyword.
    assert set(out["properties"]) == {"properties", "open", "list"}
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["properties"]["list"]["items"]["additionalProperties"] is False
    assert schema["properties"]["list"]["items"] == {"type": "object", "properties": {"b": {}}}  # not mutated
    assert json.dumps(closed_objects(True)) == "true"


def _rambling_run(backend: GrammarBackend, spec: StructuredSpec, max_tokens: int, seed: int) -> str:
    """Generate under the grammar with logits that favour long words and penalize every closing
    token, as a small model stuck in a string does; returns the text when max_tokens cuts it."""
    tok = default_tokenizer()
    vocab = len(tok)
    g = backend.matcher(spec, start=0)
    gen = torch.Generator().manual_seed(seed)
    closers = {t for t in range(vocab) if any(c in tok.decode([t]) for c in '"}]')}
    bias = torch.zeros(vocab)
    bias[list(closers)] = -8.0
    bias[EOS] = -8.0
    out: list[int] = []
    params = SamplingParams(temperature=0.7, max_tokens=max_tokens)
    while len(out) < max_tokens:
        allowed = fill_bitmask([g], [out], vocab, [max_tokens - len(out)])
        logits = (torch.randn(1, vocab, generator=gen) + bias).unsqueeze(0)[0]
        token = sample(logits, [params], [len(out)], allowed)[0].token_id
        if token == EOS:
            break
        out.append(token)
    return tok.decode(out)


@pytest.mark.parametrize("max_tokens", [40, 64])  # the shortest calls take 26 and 33 tokens
def test_budget_steering_finishes_forced_calls(backend: GrammarBackend, max_tokens: int) -> None:
    # Without steering such a model is cut inside the string; with it every answer is complete.
    parser_tools = [WEATHER, SEARCH]
    for seed in range(4):
        text = _rambling_run(backend, forced_grammar(parser_tools), max_tokens, seed)
        _, calls = ToolCallParser().find_calls(text)
        assert len(calls) == 1 and calls[0].error is None, text
        args = calls[0].arguments
        assert set(args) >= set(({"get_weather": ["city", "days"], "web_search": ["query"]})[calls[0].name])
        if calls[0].name == "get_weather":
            assert 1 <= args["days"] <= 7
    schema = {"type": "object", "properties": {"title": {"type": "string"}, "tags": {
        "type": "array", "items": {"type": "string"}}}, "required": ["title", "tags"]}
    text = _rambling_run(backend, StructuredSpec.json_schema(schema), max_tokens, 0)
    assert set(json.loads(text)) == {"title", "tags"}


def test_budget_steering_leaves_free_text_alone(backend: GrammarBackend) -> None:
    # "auto" outside a call is already complete at every token: nothing to steer, no forced stop.
    g = backend.matcher(auto_grammar([WEATHER]), start=0)
    out = encode("The weather is")
    fill_bitmask([g], [out], len(default_tokenizer()), [3])
    assert not g.closing
